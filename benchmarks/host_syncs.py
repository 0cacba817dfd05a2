"""Host-device synchronisations per decode step of the worker on CUDA, by sampling configuration.

    python benchmarks/host_syncs.py [--batch 8] [--max-tokens 32] [--model M --load-format dummy]

Runs `LLM.chat` on the embedded model (bf16, CUDA graphs) and counts, with PyTorch's sync
debug mode, the synchronising calls of every worker step (`ModelRunner.launch` and `finish`)
(`tests/gpu/sync_count.py`), plus the packer's copy of the frame, which that mode does not
see. Reported: per configuration, synchronisations per steady decode step (median, max) and the
source lines of the ones PyTorch saw. Writes benchmarks/results/host_syncs.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import machine_info, print_table, write_json  # noqa: E402
from fastdeploy import LLM  # noqa: E402
from fastdeploy.common.guided_spec import GuidedSpec  # noqa: E402
from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.sync_count import count_step_syncs, steady_decode  # noqa: E402

NAME = "host_syncs"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def configurations(max_tokens: int) -> dict[str, SamplingParams]:
    base = dict(max_tokens=max_tokens, ignore_eos=True, return_sampling_mask=False)
    return {
        "greedy": SamplingParams(temperature=0.0, **base),
        "top_p=0.9 + logprobs=5": SamplingParams(temperature=0.8, top_p=0.9, logprobs=5, **base),
        "top_k=50 + min_p=0.05 + seed": SamplingParams(temperature=0.8, top_k=50, min_p=0.05, seed=1, **base),
        "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5, **base),
        "top_p + sampling mask": SamplingParams(temperature=0.8, top_p=0.9,
                                                **{**base, "return_sampling_mask": True}),
        "json schema (greedy)": SamplingParams(temperature=0.0, guided=GuidedSpec("json_schema", json.dumps(SCHEMA)),
                                               max_tokens=max_tokens, return_sampling_mask=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    llm = LLM(args.model, load_format=args.load_format, device="cuda", max_num_seqs=args.batch,
              enforce_eager=args.enforce_eager, enable_keep_sampling_mask=True)
    chats = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(args.batch)]
    runner = llm.engine.executor.runner
    rows = []
    for label, params in configurations(args.max_tokens).items():
        llm.chat(chats, msgspec.structs.replace(params, max_tokens=4))  # warm-up: kernels, grammar compile
        with count_step_syncs(runner) as steps:
            llm.chat(chats, params)
        decode = steady_decode(steps)
        totals = [s.total for s in decode] or [0]
        sources = collections.Counter(src.split("fastdeploy/", 1)[-1] for s in decode for src in s.sources)
        rows.append({"config": label, "decode_steps": len(decode), "syncs_median": statistics.median(totals),
                     "syncs_max": max(totals), "seen_by_torch": dict(sources)})
    print_table(rows, ["config", "decode_steps", "syncs_median", "syncs_max"])
    for row in rows:
        print(f"{row['config']}: {row['seen_by_torch'] or 'only the packed frame'}")
    print(write_json(NAME, {"benchmark": NAME, "machine": machine_info(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()

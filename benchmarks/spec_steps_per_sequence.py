"""Steps each sequence of one speculating batch needs: a batch's time is its slowest sequence's.

    python benchmarks/spec_steps_per_sequence.py [--batch 64] [--method mtp|ngram] [--device cpu]

Offline, greedy, `--max-tokens` tokens with EOS ignored, `speculative.py`'s prompts (`--prompts
long`: a JSON array of four records to repeat, as gpu_scale's speculation parts), every step
drafting the configured number (`"adaptive": false`, so that what a sequence needs is its text's,
not the draft policy's). Without speculation every sequence takes `--max-tokens` steps; with it,
each takes as many as its drafts leave, and the batch runs until its slowest is done. The steps are
counted per sequence from the frames the token processor applies (one per step a sequence is in).
Prints the spread and the slowest sequence's answer; writes benchmarks/results/<name>.json and a
PNG (steps per sequence, sorted).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402,I001
from benchmarks.speculative import PROMPT_KINDS, prompts  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.common.step_frame import split_by_sequence, unpack_step_frame  # noqa: E402
from fastdeploy.output.token_processor import TokenProcessor  # noqa: E402

SPECS = {
    "mtp": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
              "adaptive": False},
}


def count_steps(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> tuple[list[int], list]:
    """Steps per conversation (in order) and the outputs of one `llm.chat` over all of them."""
    steps: collections.Counter[int] = collections.Counter()
    apply = TokenProcessor.apply

    def counting(self, frame_bytes, sequences, *args, **kwargs):
        for part in split_by_sequence(unpack_step_frame(frame_bytes), with_masks=False):
            steps[part.seq_id] += 1
        return apply(self, frame_bytes, sequences, *args, **kwargs)

    TokenProcessor.apply = counting  # offline, the engine's processor runs in this process
    try:
        outputs = llm.chat(conversations, params)
    finally:
        TokenProcessor.apply = apply
    # Sequence ids are handed out in submission order: the i-th smallest is conversation i.
    return [steps[seq_id] for seq_id in sorted(steps)], outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory; default: the embedded model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--method", choices=sorted(SPECS), default="mtp")
    parser.add_argument("--prompts", choices=PROMPT_KINDS, default="long")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--name", default="spec_steps_per_sequence")
    args = parser.parse_args()
    info = machine_info()
    print_machine(info)
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch, guided_decoding_backend="off",
              speculative_config=SPECS[args.method])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    steps, outputs = count_steps(llm, prompts(args.batch, args.prompts), params)
    slowest = max(range(len(steps)), key=steps.__getitem__)
    rest = sorted(steps)[:-1]
    row = {"batch": args.batch, "method": args.method, "max_tokens": args.max_tokens,
           "mean_steps": round(statistics.mean(steps), 2), "min_steps": min(steps), "max_steps": max(steps),
           "second_slowest_steps": rest[-1] if rest else None, "slowest_prompt": slowest,
           "slowest_over_mean": round(max(steps) / statistics.mean(steps), 3)}
    print_table([row], list(row))
    print(f"prompt {slowest}'s answer: {outputs[slowest].outputs[0].text[:400]!r}")
    path = write_json(args.name, {"benchmark": "spec_steps_per_sequence", "machine": info, "device": args.device,
                                  "spec": SPECS[args.method], "prompts": args.prompts, "summary": row,
                                  "steps": steps, "slowest_answer": outputs[slowest].outputs[0].text})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(sorted(steps), "o", ms=3, label=f"{args.method}, {args.batch} sequences")
    ax.axhline(args.max_tokens, color="gray", ls="--", lw=0.8, label="without speculation")
    ax.set_xlabel("sequence (sorted)")
    ax.set_ylabel("steps")
    ax.legend()
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

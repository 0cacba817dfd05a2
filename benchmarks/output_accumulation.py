"""Host cost of turning a long generation's deltas into its output, per token, by length.

    python benchmarks/output_accumulation.py [--lengths 1024 8192 32768] [--top-logprobs 5]

Every engine delta of a request goes through `RequestOutputState.update` (detokenize, stop
strings, logprob entries) and `CompletionOutput.add` (the text, token ids and logprobs kept for
the offline result or a non-streaming response). RL rollouts run to tens of thousands of
tokens, so a per-delta cost that grows with what was generated before adds up to seconds of
host time per sequence, which a host-bound step pays for every row. This feeds one request's
deltas, one token each, as a decode step makes them: the embedded model's tokenizer, a token
sequence cut from English text and repeated, greedy logprob rows of `--top-logprobs` entries
(and none), a stop string that never matches (and none). Reported per configuration and length:
µs per token over the whole generation and over its last 1,024 tokens (a cost that grows with
the length shows as the second above the first).

Writes benchmarks/results/<name>.json and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from fastdeploy.common.request import RequestDelta  # noqa: E402
from fastdeploy.common.sampling_params import SamplingParams  # noqa: E402
from fastdeploy.model_executor.model_loader import get_tokenizer  # noqa: E402
from fastdeploy.output.detokenizer import TokenTexts  # noqa: E402
from fastdeploy.output.output_processor import CompletionOutput, RequestOutputState  # noqa: E402

TEXT = ("The engine schedules requests in steps; each step computes one token for every running "
        "sequence, samples it, and hands the new tokens to the processes that stream them out. ")
TAIL = 1024


def run(tokenizer, token_texts: TokenTexts, tokens: list[int], length: int, top: int, stop: list[str]
        ) -> tuple[float, float]:
    """(µs per token over all `length` deltas, µs per token over the last TAIL of them)."""
    params = SamplingParams(max_tokens=length, logprobs=top if top else None, stop=stop)
    state = RequestOutputState(params, tokenizer, token_texts)
    output = CompletionOutput()
    top_ids = tokens[:top + 1]
    values = [-0.1 * i for i in range(top + 1)]
    start = time.perf_counter()
    tail_start = start
    for i in range(length):
        if i == length - TAIL:
            tail_start = time.perf_counter()
        token = tokens[i % len(tokens)]
        delta = RequestDelta("r", [token], logprobs=[values] if top else None,
                             logprob_token_ids=[[token] + top_ids[1:]] if top else None,
                             finish_reason="length" if i == length - 1 else None)
        output.add(state.update(delta))
    end = time.perf_counter()
    assert len(output.token_ids) == length
    return 1e6 * (end - start) / length, 1e6 * (end - tail_start) / min(TAIL, length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--top-logprobs", type=int, default=5)
    ap.add_argument("--name", default="output_accumulation")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    tokenizer = get_tokenizer(None)
    token_texts = TokenTexts(tokenizer)
    tokens = tokenizer.encode(TEXT * 8, add_special_tokens=False)
    configs = {"plain": (0, []), "logprobs": (args.top_logprobs, []), "logprobs+stop": (args.top_logprobs, ["<<END>>"])}
    rows = []
    for label, (top, stop) in configs.items():
        for length in args.lengths:
            whole, tail = run(tokenizer, token_texts, tokens, length, top, stop)
            rows.append({"config": label, "tokens": length, "us_per_token": round(whole, 2),
                         "us_per_token_last_1024": round(tail, 2)})
            print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in configs:
        mine = [r for r in rows if r["config"] == label]
        ax.plot([r["tokens"] for r in mine], [r["us_per_token_last_1024"] for r in mine], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("µs per token, last 1,024 tokens")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()

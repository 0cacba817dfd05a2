"""Host time of streaming detokenization per token: the Rust tokenizer's decode called directly
(`fast_decoder`) against the transformers wrapper's `decode`, with the wrapper's clean-up of
tokenization spaces off (the embedded tokenizer's setting) and on (Llama 3's).

    python benchmarks/detokenize_cost.py [--tokens 512] [--reps 5]

Each configuration streams the same text through `IncrementalDetokenizer`, one token per call
(as a decode step gives each sequence), and reports microseconds per token (best of `--reps`)
and whether the streamed text equals the whole decode. A server pays this per streamed token,
and an in-process step pays it for every sequence of the batch. Writes
benchmarks/results/detokenize_cost.json (or `--name`) and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import (  # noqa: E402
    finish_bar_axis,
    machine_info,
    png_path,
    print_machine,
    print_table,
    pyplot,
    write_json,
)
from fastdeploy.model_executor.model_loader import get_tokenizer  # noqa: E402
from fastdeploy.output.detokenizer import IncrementalDetokenizer, fast_decoder  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog, isn't it? Yes . They 're here ! "
        "def f(x):\n    return x ** 2  # naïve café 東京 🎉\n")


def streamed_us(tokenizer, ids: list[int], fast: bool, reps: int) -> tuple[float, str]:
    best, text = float("inf"), ""
    for _ in range(reps):
        detok = IncrementalDetokenizer(tokenizer)
        if not fast:
            detok._fast = None  # the wrapper's decode
        start = time.perf_counter()
        text = "".join(detok.add([token]) for token in ids)
        best = min(best, (time.perf_counter() - start) / len(ids) * 1e6)
    return best, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default="detokenize_cost")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    rows = []
    for clean_up in (False, True):
        tokenizer = get_tokenizer(None)
        tokenizer.clean_up_tokenization_spaces = clean_up
        # Recent transformers skip the clean-up for BPE vocabularies unless told not to.
        tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = clean_up
        ids = (tokenizer.encode(TEXT, add_special_tokens=False) * args.tokens)[:args.tokens]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        for fast in (True, False):
            if fast and fast_decoder(tokenizer) is None:
                continue
            us, text = streamed_us(tokenizer, ids, fast, args.reps)
            rows.append({"clean_up": clean_up, "path": "rust decode" if fast else "wrapper decode",
                         "us_per_token": us, "equals_whole_decode": text == whole})
    print_table(rows, ["clean_up", "path", "us_per_token", "equals_whole_decode"])
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(rows)), [r["us_per_token"] for r in rows], label="IncrementalDetokenizer.add, one token")
    ax.set_xticks(range(len(rows)), [f"{r['path']}\nclean-up {'on' if r['clean_up'] else 'off'}" for r in rows],
                  fontsize=8)
    finish_bar_axis(ax, "host µs per streamed token")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()

"""What a speculative step costs per draft cap, in process, with the cap held fixed.

    python benchmarks/mtp_step_cost.py [--method mtp|ngram] [--shape smollm2-135m|llama-1b|llama3-8b-dummy]
        [--device cuda] [--batches 1 16] [--tokens 256] [--tokenizer DIR] [--device-timeline] [--name NAME]
        [--caps 0 1 2] [--patterns 0,0,0,0,2 ...]

One engine without speculation and one with MTP (2 drafts; `--method ngram`: n-gram lookup of
2 drafts, suffixes of 1-3 tokens), the draft policy replaced by one that always gives the same
cap (0, 1, 2: `FixedCap`; `--patterns`: caps taken in turn, `PatternCap`), greedy, EOS ignored,
token-id prompts.
Per batch and cap: milliseconds per engine step (best of `--reps` runs), tokens per step per
sequence, the drafts' acceptance, and whether the text equals the engine's without speculation.

The models are built here, no checkpoint needed:

- `smollm2-135m`, `llama-1b`: a Llama of that shape (the embedded model's; Llama-3.2-1B's
  layers) whose next token is mostly a function of the token itself (its layers write into the
  residual stream at `--write-scale`), and an MTP head that computes that function (it passes
  the token's embedding on): drafts that are often accepted, as a trained head's would be.
- `llama3-8b-dummy`: Llama-3-8B's layers with dummy weights (`--load-format dummy`) and a random
  head: no draft is accepted, so the figure is what a verify step costs against a plain step.

The vocabulary is the embedded model's (49,152), so the embedded tokenizer decodes every id
(`--tokenizer`, default: the embedded GGUF's). Writes benchmarks/results/<name>.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import finish_bar_axis, machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402,I001
from benchmarks.verify_step import SMOLLM2_135M, counted_steps, device_ms_per_step  # noqa: E402
from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.model_executor.model_loader.embedded import embedded_model_path  # noqa: E402
from fastdeploy.model_executor.model_loader.safetensors_loader import hf_model_config  # noqa: E402
from fastdeploy.model_executor.models.mtp import MTPHead, mtp_config, save_mtp_head  # noqa: E402

NUM_DRAFTS = 2
LLAMA_1B_LAYERS = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}
LLAMA3_8B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fastdeploy", "model_executor", "models",
                         "configs", "llama3_8b.json")


class FixedCap:
    """A draft policy that gives every step the same cap and learns nothing."""

    def __init__(self, cap: int) -> None:
        self.k = cap

    def cap(self, num_rows: int) -> int:
        return self.k

    def observe(self, *args: object, **kwargs: object) -> None:
        pass

    def describe(self) -> str:
        return f"fixed {self.k}"


class PatternCap:
    """A draft policy that gives steps the caps of `pattern` in turn, over and over, and keeps
    the seconds the engine observed for each step by (the cap before, its cap): what a switch
    between caps costs against a run of one cap."""

    def __init__(self, pattern: list[int]) -> None:
        self.pattern = pattern
        self.k = max(pattern)
        self._next = 0
        self._last = pattern[-1]
        self.seconds: dict[tuple[int, int], list[float]] = {}

    def cap(self, num_rows: int) -> int:
        cap = self.pattern[self._next % len(self.pattern)]
        self._next += 1
        return cap

    def observe(self, num_rows: int, cap: int, num_tokens: int, seconds: float, *args: object,
                **kwargs: object) -> None:
        self.seconds.setdefault((self._last, cap), []).append(seconds)
        self._last = cap

    def describe(self) -> str:
        return "pattern " + ",".join(map(str, self.pattern))

    def transitions_ms(self) -> dict[str, float]:
        """Median ms a step per "cap before->cap" (the median resists the warm-up's steps)."""
        return {f"{a}->{b}": round(1e3 * statistics.median(v), 3) for (a, b), v in sorted(self.seconds.items())}


def cap_policy(spec: str) -> FixedCap | PatternCap:
    """"2": every step cap 2; "0,0,0,2": the caps in turn (`PatternCap`)."""
    caps = [int(c) for c in spec.split(",")]
    return FixedCap(caps[0]) if len(caps) == 1 else PatternCap(caps)


def _fill(module: torch.nn.Module, write_scale: float) -> None:
    """Norms 1; projections that write into the residual stream N(0, write_scale); the rest N(0, 0.02)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, write_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)


def build_models(shape: str, out: str, write_scale: float) -> tuple[dict, str]:
    """(LLM keyword arguments of the target, the MTP head's directory)."""
    torch.manual_seed(0)
    model_dir = os.path.join(out, "model")
    head_dir = os.path.join(out, "head")
    if shape == "llama3-8b-dummy":
        with open(LLAMA3_8B) as f:
            cfg = json.load(f)
        cfg.update(vocab_size=SMOLLM2_135M["vocab_size"], bos_token_id=1, eos_token_id=2)
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        head = MTPHead(mtp_config(hf_model_config(model_dir)))
        _fill(head, 0.02)
        save_mtp_head(head, head_dir)
        return {"model": model_dir, "load_format": "dummy"}, head_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in SMOLLM2_135M.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg["tie_word_embeddings"] = False
    if shape == "llama-1b":
        cfg.update(LLAMA_1B_LAYERS)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    _fill(model, write_scale)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    head = MTPHead(mtp_config(hf_model_config(model_dir)))
    _fill(head, write_scale)
    hidden = head.config.hidden_size
    with torch.no_grad():  # the head's block input is the token's embedding, its hidden input unused
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, :hidden] = torch.eye(hidden)
    save_mtp_head(head, head_dir)
    return {"model": model_dir}, head_dir


def prompts(batch: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(100 + 7 * b, 164 + 7 * b))} for b in range(batch)]


def measure(llm: LLM, batch: int, tokens: int, reps: int) -> tuple[dict, list]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts(batch), params)  # warm-up: every shape the timed runs reach
    best, texts = None, []
    for _ in range(reps):
        stats = llm.engine.spec_stats
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_draft_tokens
        with counted_steps(llm) as steps:
            start = time.perf_counter()
            outputs = llm.generate(prompts(batch), params)
            wall = time.perf_counter() - start
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        stats = llm.engine.spec_stats
        row = {"batch": batch, "steps": steps[0], "ms_per_step": 1e3 * wall / steps[0], "tok_s": made / wall,
               "tokens_per_step_per_seq": made / steps[0] / batch,
               "acceptance": (stats.num_accepted_draft_tokens - accepted) / max(1, stats.num_draft_tokens - drafted)}
        if best is None or row["ms_per_step"] < best["ms_per_step"]:
            best, texts = row, [o.outputs[0].token_ids for o in outputs]
    assert best is not None
    return best, texts


def add_engine_args(ap: argparse.ArgumentParser, batches: list[int], tokens: int) -> None:
    """The options that pick the engines' models, device and load (shared with spec_host_profile.py)."""
    ap.add_argument("--method", choices=["mtp", "ngram"], default="mtp")
    ap.add_argument("--shape", choices=["smollm2-135m", "llama-1b", "llama3-8b-dummy"], default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=batches)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--write-scale", type=float, default=5e-5)
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--tokenizer", default=None, help="default: the embedded GGUF's")


def build_engines(args: argparse.Namespace, out: str) -> tuple[LLM, LLM]:
    """(the engine without speculation, the one with `args.method`), models written under `out`."""
    target, head_dir = build_models(args.shape, out, args.write_scale)
    common = dict(device=args.device, max_num_seqs=max(args.batches), guided_decoding_backend="off",
                  num_kv_blocks=args.num_kv_blocks, tokenizer=args.tokenizer or embedded_model_path(), **target)
    spec = {"method": "mtp", "num_speculative_tokens": NUM_DRAFTS, "model": head_dir} if args.method == "mtp" \
        else {"method": "ngram", "num_speculative_tokens": NUM_DRAFTS, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return LLM(**common), LLM(**common, speculative_config=spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, batches=[1, 16], tokens=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--caps", type=int, nargs="*", default=list(range(NUM_DRAFTS + 1)),
                    help="the fixed caps measured (default: every one)")
    ap.add_argument("--patterns", nargs="*", default=[],
                    help='cap sequences the steps take in turn, such as "0,0,0,0,2" (besides the fixed caps): '
                         "ms a step, and the median observed step per switch")
    ap.add_argument("--device-timeline", action="store_true",
                    help="CUDA: the device's busy time per step (a step well above it is the host's)")
    ap.add_argument("--name", default="mtp_step_cost")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        off, mtp = build_engines(args, tmp)
        for batch in args.batches:
            row, plain = measure(off, batch, args.tokens, args.reps)
            rows.append({"config": "off", **row, "same_as_off": True})
            for cap in [None, *args.caps]:
                llm = off if cap is None else mtp
                if cap is not None:
                    mtp.engine.draft_policy = FixedCap(cap)  # type: ignore[assignment]
                    row, texts = measure(mtp, batch, args.tokens, args.reps)
                    rows.append({"config": f"cap{cap}", **row, "same_as_off": texts == plain})
                if args.device_timeline and args.device.startswith("cuda"):
                    rows[-1]["device_ms_per_step"] = device_ms_per_step(llm, batch, args.tokens // 2)
                print(rows[-1], flush=True)
            for spec in args.patterns:
                policy = cap_policy(spec)
                mtp.engine.draft_policy = policy  # type: ignore[assignment]
                row, texts = measure(mtp, batch, args.tokens, args.reps)
                rows.append({"config": f"pattern {spec}", **row, "same_as_off": texts == plain})
                if isinstance(policy, PatternCap):
                    rows[-1]["transition_ms"] = policy.transitions_ms()
                print(rows[-1], flush=True)
        for llm in (off, mtp):
            llm.engine.shutdown()
    print_table(rows, list(rows[0]))
    path = write_json(args.name, {"machine": info, "args": vars(args), "rows": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["off"] + [f"cap{c}" for c in args.caps]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next(r["ms_per_step"] for r in rows if r["config"] == name and r["batch"] == b) for b in args.batches]
        ax.bar([x + i * width for x in range(len(args.batches))], values, width, label=name)
    ax.set_xticks([x + 1.5 * width for x in range(len(args.batches))], [f"batch {b}" for b in args.batches])
    finish_bar_axis(ax, f"ms per engine step ({args.method}, {args.shape})")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path} and {png_path(args.name)}")


if __name__ == "__main__":
    main()

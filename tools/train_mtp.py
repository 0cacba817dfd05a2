"""Train the MTP draft head for a target model by self-distillation.

    python tools/train_mtp.py --device cuda            # the embedded SmolLM2-135M-Instruct, ~3 min on an H100
    python tools/train_mtp.py --device cpu --num-prompts 16 --max-tokens 32 --steps 20 --out /tmp/head \
        --plot /tmp/head/loss.png

1. Data: chat prompts built from templates (`tools/mtp_prompts.py`; `--copy-share` of them ask to
   repeat a text given in the prompt), answered by the target itself through the fastdeploy
   engine, once greedy and once at temperature 0.7.
2. Targets: the frozen model's hidden states (after the final norm) at every position,
   from a dense causal forward of the engine's own weights (`tools/dense_llama.py`).
3. Head: pair j = (hidden j-1, embedding of token j) → distribution of token j+1, i.e. token
   t+2 from hidden t. Loss: forward KL from the target's own next-token distribution at j
   to the head's, over the generated positions. KL rather than cross-entropy on the sampled
   tokens: it carries the whole distribution (more signal per token, no sampling noise in the
   labels), and acceptance at temperature T is the overlap of exactly these two distributions.
   The embedding, final norm and output head are the target's, shared and frozen; the head's
   decoder block starts as a copy of the target's last block.
4. Second draft: the loss adds `--recursion-weight` times the same KL for a pass fed the head's
   own output at j-1 where the target's hidden state was (what drafting does from its second
   token on).

Writes `config.json` + `model.safetensors` (bf16) to `--out` via `save_mtp_head` (default: the
head shipped in the package), and the loss curve (PNG) with its log (JSON) to `--plot`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.model_loader import get_model, get_tokenizer
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.model_executor.models.mtp import (
    EMBEDDED_HEAD,
    SHIPPED_HEADS,
    MTPHead,
    mtp_config,
    save_mtp_head,
)
from tools.dense_llama import dense_hidden_states
from tools.mtp_prompts import as_chat, training_prompts


@dataclass
class Sequence:
    token_ids: list[int]  # prompt (chat template applied) + the target's continuation
    prompt_len: int


def generate_sequences(llm: LLM, prompts: list[str], max_tokens: int, temperatures: list[float],
                       seed: int, max_seconds: float = math.inf, wave: int = 1024) -> list[Sequence]:
    """The target's own answers to every prompt at every temperature (0: greedy), in waves of
    `wave` requests (each mixing temperatures, so a cut run keeps both); no wave starts once
    `max_seconds` have passed."""
    jobs = [(i, t) for t in temperatures for i in range(len(prompts))]
    random.Random(seed).shuffle(jobs)
    start = time.perf_counter()
    out: list[Sequence] = []
    for first in range(0, len(jobs), wave):
        if time.perf_counter() - start > max_seconds:
            print(f"generation stopped after {len(out)} sequences: --max-generate-seconds {max_seconds:g} passed")
            break
        chunk = jobs[first:first + wave]
        params = [SamplingParams(temperature=t, max_tokens=max_tokens, seed=seed + i) for i, t in chunk]
        outputs = llm.chat(as_chat([prompts[i] for i, _ in chunk]), params, use_tqdm=True)
        out.extend(Sequence(o.prompt_token_ids + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
                   for o in outputs if o.outputs[0].token_ids)
    return out


@torch.no_grad()
def generate_sequences_dense(target: LlamaForCausalLM, tokenizer, prompts: list[str], max_tokens: int,
                             temperatures: list[float], eos_ids: list[int], seed: int, batch_size: int,
                             max_seconds: float = math.inf) -> list[Sequence]:
    """The target's answers without the engine: each step re-runs the dense forward over the whole prefix.

    Quadratic in length, but it needs nothing the engine builds on first use (custom ops, CUDA
    graphs), which is what makes it the cheaper choice for one short run on a fresh GPU. The
    forward is the one `tests/spec_decode/test_mtp_head.py` holds equal to the engine's prefill.
    Stops starting new batches once `max_seconds` have passed.
    """
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    eos = torch.tensor(eos_ids, device=device)
    jobs = [(p, t) for t in temperatures for p in prompts]
    random.Random(seed).shuffle(jobs)  # each batch mixes temperatures, so a cut run keeps both
    start = time.perf_counter()
    out: list[Sequence] = []
    for first in tqdm(range(0, len(jobs), batch_size), desc="generating", unit="batch"):
        if time.perf_counter() - start > max_seconds:
            break
        chunk = jobs[first:first + batch_size]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in as_chat([p for p, _ in chunk])]
        prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        rows = torch.arange(len(chunk), device=device)
        lens = torch.tensor([len(x) for x in prompt_ids], device=device)
        ids = torch.zeros(len(chunk), int(lens.max()) + max_tokens, dtype=torch.long, device=device)
        for i, x in enumerate(prompt_ids):
            ids[i, :len(x)] = torch.tensor(x)
        temps = torch.tensor([t for _, t in chunk], device=device)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        for _ in range(max_tokens):
            hidden = dense_hidden_states(target, ids[:, :int(lens.max())])
            logits = target.compute_logits(hidden[rows, lens - 1])
            probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            token = torch.where(temps > 0, sampled, logits.argmax(dim=-1))
            live = rows[~done]
            ids[live, lens[live]] = token[live]
            lens[live] += 1
            done[live] |= torch.isin(token[live], eos)
            if bool(done.all()):
                break
        out.extend(Sequence(ids[i, :n].tolist(), len(x))
                   for i, (n, x) in enumerate(zip(lens.tolist(), prompt_ids, strict=True)))
    return out


def batches(seqs: list[Sequence], max_batch_tokens: int, rng: random.Random) -> list[list[Sequence]]:
    """Length-sorted batches of at most `max_batch_tokens` padded tokens, in random order."""
    ordered = sorted(seqs, key=lambda s: len(s.token_ids))
    out: list[list[Sequence]] = []
    current: list[Sequence] = []
    for s in ordered:
        if current and len(s.token_ids) * (len(current) + 1) > max_batch_tokens:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def _pad(batch: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, L] (right-padded with 0) and the loss mask [B, L] over pairs j.

    Pair j counts where it predicts a generated token the target decided: j from the first
    generated position (the first pair the server drafts from) to the second-to-last token.
    """
    length = max(len(s.token_ids) for s in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.bool)
    for i, s in enumerate(batch):
        ids[i, :len(s.token_ids)] = torch.tensor(s.token_ids)
        mask[i, s.prompt_len:len(s.token_ids) - 1] = True
    return ids.to(device), mask.to(device)


def distill_loss(head: MTPHead, target: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor,
                 recursion_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL, agreement, agreement of the second draft): the loss is the mean KL(target || head)
    over the masked pairs plus `recursion_weight` times the same KL for the head fed its own output
    (the second draft); agreement is the head's greedy agreement with the target (the second draft's
    NaN without the recursion term)."""
    hidden = dense_hidden_states(target, ids)  # [B, L, H]: hidden j predicts token j+1
    embeds = target.model.embed_tokens(ids)
    out = head.forward_dense(embeds, _after(hidden), target.model.norm)  # pair j gets hidden j-1
    # The shared output head as a plain GEMM: compute_logits' CUDA float32-output matmul has no backward.
    weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    with torch.no_grad():
        teacher = F.log_softmax(target.compute_logits(hidden[mask]), dim=-1)

    def kl_and_agreement(head_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        student = F.log_softmax(F.linear(head_out[mask], weight).float(), dim=-1)
        return (F.kl_div(student, teacher, log_target=True, reduction="batchmean"),
                (student.argmax(-1) == teacher.argmax(-1)).float().mean())

    kl, agree = kl_and_agreement(out)
    if not recursion_weight:
        return kl, kl, agree, torch.tensor(float("nan"))
    # A second draft feeds the head's output at j-1 where the target's hidden state was: pair j
    # then holds the head's stand-in for hidden j-1 (teacher-forced token j, as in the first pass).
    again = head.forward_dense(embeds, _after(out), target.model.norm)
    kl_again, agree_again = kl_and_agreement(again)
    return kl + recursion_weight * kl_again, kl, agree, agree_again


def _after(states: torch.Tensor) -> torch.Tensor:
    """[B, L, H] moved one position later (zeros first): pair j gets the state of position j-1."""
    return torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)


def init_head(target: LlamaForCausalLM, intermediate_size: int | None) -> MTPHead:
    """A head whose decoder block copies the target's last one (a better start than random)."""
    config = mtp_config(target.config, intermediate_size)
    head = MTPHead(config)
    last = target.model.layers[-1].state_dict()
    if config.intermediate_size == target.config.intermediate_size:
        head.layer.load_state_dict(last)
    else:  # a narrower MLP: copy attention and norms, keep the MLP's fresh init
        head.layer.load_state_dict({k: v for k, v in last.items() if ".mlp." not in f".{k}"}, strict=False)
    return head


def train(head: MTPHead, target: LlamaForCausalLM, seqs: list[Sequence], steps: int, lr: float,
          max_batch_tokens: int, seed: int, max_seconds: float = math.inf,
          recursion_weight: float = 0.0) -> list[dict[str, float]]:
    """AdamW over length-bucketed batches for `steps` steps or `max_seconds`, whichever ends first.

    The schedule (linear warm-up, cosine decay to a tenth) follows whichever of the two is further
    along, so a run cut by the clock still anneals.
    """
    device = next(target.parameters()).device
    head.to(device=device, dtype=torch.float32).train()
    optim = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(seed)
    pending: list[list[Sequence]] = []
    log = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    start = time.perf_counter()
    bar = tqdm(total=steps, desc="training", unit="step")
    for step in range(steps):
        progress = max(step / steps, (time.perf_counter() - start) / max_seconds)
        if progress >= 1:
            break
        scale = progress / 0.05 if progress < 0.05 else 0.1 + 0.45 * (1 + math.cos(math.pi * (progress - 0.05) / 0.95))
        for group in optim.param_groups:
            group["lr"] = lr * max(scale, 0.01)
        if not pending:
            pending = batches(seqs, max_batch_tokens, rng)
        ids, mask = _pad(pending.pop(), device)
        with autocast:
            loss, kl, agree, agree_again = distill_loss(head, target, ids, mask, recursion_weight)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optim.step()
        entry = {"step": step, "loss": loss.item(), "kl": kl.item(), "top1_agree": agree.item(),
                 "top1_agree_second_draft": agree_again.item(), "tokens": int(mask.sum()),
                 "lr": optim.param_groups[0]["lr"]}
        log.append(entry)
        bar.update(1)
        bar.set_postfix(kl=f"{entry['kl']:.3f}", agree=f"{entry['top1_agree']:.3f}")
    bar.close()
    return log


def plot_loss(log: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [e["kl"] for e in log], color="tab:blue", label="KL(target || head)")
    ax.set_xlabel("step")
    ax.set_ylabel("KL (nats / token)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, [e["top1_agree"] for e in log], color="tab:orange", label="top-1 agreement")
    ax2.set_ylabel("top-1 agreement with the target", color="tab:orange")
    ax.set_title("MTP head self-distillation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-prompts", type=int, default=3072, help="templated prompts, each answered twice")
    p.add_argument("--copy-share", type=float, default=0.35,
                   help="share of the prompts that ask to repeat a record, code snippet or passage given in them")
    p.add_argument("--max-tokens", type=int, default=256, help="longest continuation generated per prompt")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine batch while generating")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recursion-weight", type=float, default=0.5,
                   help="weight of the loss with the head fed its own output (second draft); 0: first draft only")
    p.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per training step")
    p.add_argument("--max-train-seconds", type=float, default=math.inf, help="stop training early after this")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="engine KV blocks while generating (default on CUDA: 8192, leaving memory for training)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator", choices=["engine", "dense"], default="engine",
                   help="engine: the fastdeploy engine (batched, paged); dense: re-run the dense forward per "
                        "token, no engine start-up (for a short run on a fresh GPU)")
    p.add_argument("--max-generate-seconds", type=float, default=math.inf,
                   help="start no new batch (dense) or wave of requests (engine) after this")
    p.add_argument("--save-data", default=None, help="only generate: write the sequences to this JSON file")
    p.add_argument("--data", default=None, help="train on sequences from --save-data instead of generating")
    p.add_argument("--out", default=os.path.join(SHIPPED_HEADS, EMBEDDED_HEAD), help="checkpoint directory")
    p.add_argument("--plot", default=None,
                   help="loss curve PNG; its .json twin holds the log (default: benchmarks/results/mtp_train_loss.png)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.data:  # sequences generated earlier (--save-data), possibly on another machine
        with open(args.data) as f:
            seqs = [Sequence(ids, n) for ids, n in json.load(f)["sequences"]]
        target, _ = get_model(args.model, dtype=dtype, device=args.device, gguf_quantized=False)
    elif args.generator == "dense":
        target, config = get_model(args.model, dtype=dtype, device=args.device, gguf_quantized=False)
        seqs = generate_sequences_dense(target, get_tokenizer(args.model),
                                        training_prompts(args.num_prompts, args.seed, args.copy_share), args.max_tokens,
                                        args.temperatures, list(config.eos_token_ids), args.seed,
                                        args.max_num_seqs, args.max_generate_seconds)
    else:
        # On CUDA the engine would otherwise size its KV pool from all free memory, leaving none to train in.
        blocks = args.num_kv_blocks or (8192 if args.device.startswith("cuda") else None)
        llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs, guided_decoding_backend="off",
                  num_kv_blocks=blocks)
        # The head trains against dense weights: the engine's are on a GPU, while on the CPU it keeps
        # a GGUF's projections in their 4-bit blocks (no state dict to start the head from, no backward).
        target = llm.engine.executor.runner.model if args.device.startswith("cuda") else \
            get_model(args.model, dtype=dtype, device=args.device, gguf_quantized=False)[0]
        seqs = generate_sequences(llm, training_prompts(args.num_prompts, args.seed, args.copy_share), args.max_tokens,
                                  args.temperatures, args.seed, args.max_generate_seconds)
    generated_s = time.perf_counter() - started
    num_tokens = sum(len(s.token_ids) for s in seqs)
    print(f"{len(seqs)} sequences, {num_tokens} tokens "
          f"({sum(len(s.token_ids) - s.prompt_len for s in seqs)} generated) in {generated_s:.1f} s")
    if args.save_data:
        with open(args.save_data, "w") as f:
            json.dump({"sequences": [[s.token_ids, s.prompt_len] for s in seqs]}, f)
        return

    head = init_head(target, args.intermediate_size)
    log = train(head, target, seqs, args.steps, args.lr, args.batch_tokens, args.seed, args.max_train_seconds,
                args.recursion_weight)
    trained_s = time.perf_counter() - started - generated_s
    save_mtp_head(head, args.out, dtype=torch.bfloat16)

    plot = args.plot or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     "benchmarks", "results", "mtp_train_loss.png")
    os.makedirs(os.path.dirname(plot), exist_ok=True)
    plot_loss(log, plot)
    tail = log[-max(1, len(log) // 10):]
    summary = {
        "target": args.model or "embedded SmolLM2-135M-Instruct", "device": args.device,
        "sequences": len(seqs), "tokens": num_tokens, "prompts": args.num_prompts,
        "temperatures": args.temperatures, "max_tokens": args.max_tokens, "steps": args.steps, "lr": args.lr,
        "batch_tokens": args.batch_tokens, "intermediate_size": head.config.intermediate_size,
        "generate_s": round(generated_s, 1), "train_s": round(trained_s, 1),
        "final_kl": sum(e["kl"] for e in tail) / len(tail),
        "final_top1_agree": sum(e["top1_agree"] for e in tail) / len(tail),
        "recursion_weight": args.recursion_weight, "copy_share": args.copy_share,
        "final_top1_agree_second_draft": sum(e["top1_agree_second_draft"] for e in tail) / len(tail),
        "log": log,
    }
    with open(os.path.splitext(plot)[0] + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    print(f"saved {args.out}; loss curve {plot}; generate {generated_s:.0f} s, train {trained_s:.0f} s, "
          f"final KL {summary['final_kl']:.3f}, top-1 agreement {summary['final_top1_agree']:.3f} "
          f"(second draft {summary['final_top1_agree_second_draft']:.3f})")


if __name__ == "__main__":
    main()

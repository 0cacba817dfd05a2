"""Apply a guided-decoding token bitmask to logits, in place, for torch or Paddle tensors."""

from __future__ import annotations

from typing import Any, Literal

import torch
import xgrammar as xgr

__all__ = ["apply_token_bitmask_inplace"]


_Backend = Literal["cpu", "triton", "torch_native"]  # the xgrammar kernels used here


def _cuda_backend() -> _Backend:
    # xgrammar's default CUDA path is its Triton kernel; without Triton fall back to the
    # pure-torch one rather than its "cuda" backend, which JIT-compiles a .cu with nvcc.
    try:
        import triton  # noqa: F401

        return "triton"
    except ImportError:
        return "torch_native"


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    backend: _Backend
    if logits.device.type == "cpu":
        backend = "cpu" if logits.dtype in (torch.float32, torch.float16, torch.bfloat16) else "torch_native"
    elif logits.device.type == "cuda":
        backend = _cuda_backend()
    else:
        backend = "torch_native"
    # vocab_size = the logits' width: bitmask columns past it (padding to a multiple of 32)
    # are ignored, and a bitmask narrower than the logits is a caller bug, so let it raise.
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[-1] * 32} tokens, logits have {vocab}")
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, backend=backend)


def _is_paddle(x: Any) -> bool:
    return type(x).__module__.startswith("paddle")


def _paddle_to_torch(x: Any) -> torch.Tensor:
    """Zero-copy view of a Paddle tensor as a torch tensor (same memory)."""
    try:
        return torch.from_dlpack(x)  # Paddle >= 3 implements __dlpack__ / __dlpack_device__
    except (TypeError, AttributeError, RuntimeError):
        import paddle

        return torch.utils.dlpack.from_dlpack(paddle.utils.dlpack.to_dlpack(x))


def apply_token_bitmask_inplace(logits: Any, bitmask: Any) -> Any:
    """Set logits[b, v] = -inf wherever bit v of bitmask[b] is 0; returns `logits`.

    logits: float32/float16/bfloat16 [B, V] (or [V]), torch or Paddle, CPU or GPU.
    bitmask: int32 [B, ceil(V / 32)] (xgrammar layout: bit v % 32 of word v // 32, set =
        allowed), torch or Paddle; copied to the logits' device if it lives elsewhere.

    A Paddle tensor is viewed through DLPack without copying, so the Paddle tensor itself
    is modified and returned. Dispatches to xgrammar's kernels: its CPU kernel on CPU,
    Triton on CUDA.
    """
    t_logits = _paddle_to_torch(logits) if _is_paddle(logits) else logits
    t_bitmask = _paddle_to_torch(bitmask) if _is_paddle(bitmask) else bitmask
    _apply_torch(t_logits, t_bitmask)
    return logits

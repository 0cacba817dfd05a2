"""The paged decode attention kernel under Triton's interpreter, where there is no GPU: rows that
share a prefix give what the same rows give alone (to float32 rounding there), padding rows
write zeros, and every row matches float64 (tests/gpu/test_triton_attention.py runs the same
check, and more, on CUDA)."""

from __future__ import annotations

from tests.triton_interpreter import run_under_interpreter


def test_decode_attention_under_the_triton_interpreter() -> None:
    run_under_interpreter("tests.gpu.test_triton_attention", "decode_checks_on", 4)

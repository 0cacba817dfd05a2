"""Running a test's kernel checks under Triton's interpreter, where there is no GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_under_interpreter(module: str, function: str, cases: int) -> None:
    """`module.function(torch.device('cpu'), cases)` in a fresh interpreter with TRITON_INTERPRET
    set (it must be set before a kernel is defined, so not in this process); fails with its
    stderr."""
    pytest.importorskip("triton")
    code = f"import torch; from {module} import {function}; {function}(torch.device('cpu'), {cases})"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

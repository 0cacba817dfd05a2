"""Loading this package's C++/CUDA extensions: the one `pip install -e .` built, else a build
from custom_ops/ just in time (`torch.utils.cpp_extension.load`, about a minute)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

CUSTOM_OPS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "custom_ops")
# Extension module (under fastdeploy.ops) -> its sources in custom_ops/, as setup.py builds it.
SOURCES = {
    "_step_packer_cpu": ["step_packer.cpp"],
    "_step_packer_cuda": ["step_packer_cuda.cu"],
    "_cpu_kernels": ["gguf_matmul_cpu.cpp", "cpu_decode_ops.cpp"],
}
# Built with OpenMP, as setup.py does: their at::parallel_for runs on one thread without it.
OPENMP = {"_cpu_kernels"}


def is_built(module: str) -> bool:
    spec = importlib.util.find_spec(f"fastdeploy.ops.{module}")
    return spec is not None and bool(spec.origin)


@functools.cache
def load_extension(module: str) -> None:
    """Registers the ops of extension `module` with torch.ops, building it first if it was not built."""
    spec = importlib.util.find_spec(f"fastdeploy.ops.{module}")
    if spec is not None and spec.origin:
        torch.ops.load_library(spec.origin)
        return
    sources = [os.path.join(CUSTOM_OPS_DIR, name) for name in SOURCES[module]]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise RuntimeError(f"fastdeploy.ops.{module} is not built and {', '.join(missing)} is missing")
    from torch.utils.cpp_extension import load

    openmp = ["-fopenmp"] if module in OPENMP else []
    load(name=f"fastdeploy{module}", sources=sources, extra_include_paths=[CUSTOM_OPS_DIR],
         extra_cflags=["-O3", *openmp], extra_ldflags=openmp, extra_cuda_cflags=["-O3"], is_python_module=False)

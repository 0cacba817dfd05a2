"""Seconds since this process was launched: what its start-up cost before its own code ran
(interpreter, imports, a spawned child's unpickling), for the start-up log lines."""

from __future__ import annotations

import os
import time

import psutil


def seconds_since_launch() -> float:
    return time.time() - psutil.Process(os.getpid()).create_time()

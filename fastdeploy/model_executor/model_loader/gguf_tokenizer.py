"""A GGUF file's tokenizer, converted from its metadata once and then read from a disk cache.

Converting means parsing every metadata array of the file (49k vocabulary strings and as
many merges for SmolLM2) through `gguf` and transformers: 8-9 s of CPU in each process that
loads it (the API server at start-up; the worker when its first guided request arrives).
The converted tokenizer, saved with `save_pretrained`, loads in about 0.3 s.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fastdeploy.model_executor.model_loader.gguf_file import read_gguf

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "FASTDEPLOY_CACHE_DIR"
# Written last: a directory without it is an interrupted save, never read.
COMPLETE_MARKER = "fastdeploy-complete"


def cache_root() -> Path:
    """$FASTDEPLOY_CACHE_DIR, else $XDG_CACHE_HOME/fastdeploy, else ~/.cache/fastdeploy."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastdeploy"


def cache_entry(path: str) -> Path:
    """The cache directory of the GGUF at `path`: a new file, a rewritten one or another
    transformers (which does the conversion) gets a new entry."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return cache_root() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def convert_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from the GGUF's metadata, with the file's chat template."""
    loaded = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
                                           local_files_only=True)
    if loaded.chat_template is None:
        loaded.chat_template = read_gguf(path).metadata.get("tokenizer.chat_template")
    return loaded


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    entry = cache_entry(path)
    if (entry / COMPLETE_MARKER).is_file():
        cached = _loads(entry)
        if cached is not None:
            return cached
    tokenizer = convert_gguf_tokenizer(path)
    try:
        _store(tokenizer, entry)
    except OSError as exc:  # a read-only or full cache directory costs time, not correctness
        logger.warning("could not cache the tokenizer of %s in %s: %s", path, entry, exc)
    return tokenizer


def _loads(entry: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in `entry`, or None where it cannot be read (it is then converted again)."""
    try:
        return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any damage means the same: convert again
        logger.warning("tokenizer cache %s is unreadable (%s); converting again", entry, exc)
        return None


def _store(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=entry.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        (staging / COMPLETE_MARKER).touch()
        if (entry / COMPLETE_MARKER).is_file() and _loads(entry) is not None:
            return  # another process stored it while this one converted
        if entry.exists():
            shutil.rmtree(entry)  # damaged (no marker, or unreadable)
        os.replace(staging, entry)  # atomic: a process reading beside us sees all of it or none
    except OSError:
        if entry.is_dir() and (entry / COMPLETE_MARKER).is_file():
            return  # another process stored the same entry first
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)

"""Prefix hashes of full KV blocks: a block's key covers its tokens and every token before it.

Block i's hash is a digest of block i - 1's hash and block i's token ids, so equal hashes mean
equal prefixes (a 128-bit BLAKE2b digest: a collision, which would hand a sequence another
prefix's K/V, is not a practical concern). The chain starts from a digest of what else fixes
the K/V: the model and the cache dtype, so caches of different weights never match.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16


def root_hash(model_id: str, dtype: str) -> bytes:
    return hashlib.blake2b(f"{model_id}\0{dtype}".encode(), digest_size=DIGEST_BYTES).digest()


def extend_block_hashes(hashes: list[bytes], tokens: list[int], block_size: int, root: bytes) -> None:
    """Append to `hashes` (those of the first len(hashes) blocks of `tokens`) the hashes of
    every further full block of `tokens`."""
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(hashes[-1] if hashes else root, digest_size=DIGEST_BYTES)
        digest.update(array("q", tokens[start:start + block_size]).tobytes())
        hashes.append(digest.digest())

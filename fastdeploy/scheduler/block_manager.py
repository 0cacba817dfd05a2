"""KV block pool: which physical blocks each sequence holds, and which full blocks are cached.

Without prefix caching a block has one owner. With it, a full block whose tokens (and every
token before them) are known is registered under its prefix hash (`prefix_hash.py`); another
sequence with the same prefix takes the same block by reference, and a block nobody holds
stays cached, evictable in least-recently-freed order, until its memory is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing worth keeping
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # registered block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> the block that holds it
        # Registered blocks no sequence holds, oldest first: taken (and forgotten) when the
        # free list is empty.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Prefix-cache counters since start, in tokens: looked up at admission, and found.
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding `block_ids` can hold `num_tokens` tokens in total."""
        return blocks_needed(num_tokens, self.block_size) - len(block_ids) <= self.num_free_blocks

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append blocks to `block_ids` until it holds `num_tokens` tokens."""
        missing = blocks_needed(num_tokens, self.block_size) - len(block_ids)
        if missing > self.num_free_blocks:
            raise RuntimeError("KV block pool exhausted; call can_grow first")
        for _ in range(missing):
            block = self._take()
            self._refs[block] = 1
            block_ids.append(block)

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def free(self, block_ids: list[int]) -> None:
        # Last block first: a prefix's tail is evicted before its head, which more prompts share.
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        block_ids.clear()

    # Prefix caching.

    def cached_blocks(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest run of `hashes` from the first (a sequence's full
        blocks in order)."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def record_lookup(self, num_queried_blocks: int, num_hit_blocks: int) -> None:
        """Count an admitted sequence's lookup in the hit-rate counters (in tokens)."""
        self.query_tokens += num_queried_blocks * self.block_size
        self.hit_tokens += num_hit_blocks * self.block_size

    def num_reclaimed(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the evictable pool (taking them leaves less to allocate)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def share(self, block_ids: list[int], blocks: list[int]) -> None:
        """Append cached `blocks` to an empty `block_ids`, holding each by one more reference."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            block_ids.append(block)

    def register(self, block: int, prefix_hash: bytes) -> None:
        """Record that a full, computed `block` holds the prefix `prefix_hash`. If another block
        already holds it, that one stays the cached copy and this one stays private."""
        if prefix_hash not in self._block_of and block not in self._hash_of:
            self._block_of[prefix_hash] = block
            self._hash_of[block] = prefix_hash

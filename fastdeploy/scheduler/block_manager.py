"""KV block pool: which physical blocks each sequence owns."""

from __future__ import annotations

from collections import deque


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """A free list of fixed-size KV blocks. Blocks are owned by one sequence at a time."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding `block_ids` can hold `num_tokens` tokens in total."""
        return blocks_needed(num_tokens, self.block_size) - len(block_ids) <= len(self._free)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append blocks to `block_ids` until it holds `num_tokens` tokens."""
        missing = blocks_needed(num_tokens, self.block_size) - len(block_ids)
        if missing > len(self._free):
            raise RuntimeError("KV block pool exhausted; call can_grow first")
        for _ in range(missing):
            block_ids.append(self._free.popleft())

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
        block_ids.clear()

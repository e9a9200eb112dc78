"""Paged KV-cache block allocation: a free list of fixed-size blocks."""

from __future__ import annotations

from collections import deque

from tidal.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out KV blocks to sequences. No sharing yet, so no ref counts."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that `num_tokens` of its tokens have slots."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def num_fitting(self, seq: Sequence, num_tokens: int, extra: int, free: int | None = None) -> int:
        """The most of `extra` further tokens (<= extra) that fit after `num_tokens` of seq's
        tokens, in its blocks plus `free` more (default: all the free ones)."""
        free = len(self._free) if free is None else min(free, len(self._free))
        room = (len(seq.block_table) + free) * self.block_size - num_tokens
        return max(0, min(extra, room))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_tokens` slots; caller checked can_allocate."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError("out of KV blocks; call can_allocate first")
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []

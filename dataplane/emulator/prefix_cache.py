"""vLLM's automatic prefix cache, as its V1 engine keeps it (vllm/v1/core/kv_cache_utils.py,
block_pool.py): a prompt is cut into full blocks of `block_size` tokens, each block hashed
together with the hash of the block before it, so a block's hash names the whole prefix up to
its end. A new prompt reuses the longest run of leading blocks already in the cache; the
cache holds at most `capacity_blocks` blocks and evicts the least recently used.

As in vLLM, a hit never covers the whole prompt: the last prompt token is always computed,
since its logits give the first output token (`max_cache_hit_length = num_tokens - 1`), and
blocks are cached as soon as they are scheduled, so a prompt admitted in the same step as
another with the same prefix already hits it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    __slots__ = ("block_size", "capacity_blocks", "_blocks")

    def __init__(self, *, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _hashes(self, token_ids: Sequence[int], limit_tokens: int) -> list[int]:
        size = self.block_size
        hashes = []
        parent = 0
        for start in range(0, limit_tokens - size + 1, size):
            # Tuples of ints hash the same in every process (no string-hash salting).
            parent = hash((parent, tuple(token_ids[start : start + size])))
            hashes.append(parent)
        return hashes

    def hit_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading prompt tokens already cached (whole blocks), without touching the cache."""
        hits = 0
        for block_hash in self._hashes(token_ids, len(token_ids) - 1):
            if block_hash not in self._blocks:
                break
            hits += self.block_size
        return hits

    def admit(self, token_ids: Sequence[int]) -> None:
        """The prompt was scheduled: its blocks are (now) cached and the most recently used."""
        blocks = self._blocks
        for block_hash in self._hashes(token_ids, len(token_ids)):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

"""vLLM's automatic prefix caching, block-granular, one cache per replica.

What vLLM V1 does (vllm/v1/core/kv_cache_manager.py, kv_cache_utils.py), and so this does:

- A prompt is cut into blocks of `block_tokens` tokens (16 on CUDA); only full blocks are
  cached. A block's hash chains its parent's hash, its token ids and the hashes of the
  multimodal items whose placeholder tokens it overlaps (`_gen_mm_extra_hash_keys`), so two
  prompts share a block only if everything before it is equal too, and two images with the
  same placeholder ids never collide.
- On admission a request hits the longest run of leading blocks already cached, at most
  `num_tokens - 1` tokens, since the last token must be computed to sample from
  (`get_computed_blocks`: `max_cache_hit_length = request.num_tokens - 1`).
- Its blocks are cached when it is scheduled (`allocate_slots` → `cache_blocks`), so a
  request admitted later in the same step already hits them.
- Statistics: `queries += num_tokens`, `hits += cached tokens`, in tokens, exposed as the
  counters `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`
  (vllm/v1/metrics/loggers.py).

What is simpler here: vLLM's cached blocks are the KV pool's blocks, evicted least recently
used when a new allocation needs a free one; here the cache is an LRU index of at most
`kv_cache_tokens / block_tokens` block hashes beside the KV budget, so caching never reduces
what the replica can admit. Only prompt blocks are cached (vLLM also caches the blocks of
generated tokens, which matters for multi-turn chat, not for a benchmark's prompts).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: where its placeholder tokens are and what it is."""

    offset: int  # index of its first placeholder token in the prompt
    length: int  # placeholder tokens
    digest: bytes  # identifies the image's content (vLLM's mm_hash)

    @property
    def end(self) -> int:
        return self.offset + self.length


_ROOT_HASH = b"\0" * 16


def block_hashes(
    token_ids: Sequence[int], block_tokens: int, images: Sequence[ImageSpan] = ()
) -> list[bytes]:
    """The chained hash of every full block of `token_ids`."""
    hashes: list[bytes] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        end = start + block_tokens
        block = token_ids[start:end]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(struct.pack(f"<{block_tokens}Q", *block))
        for image in images:
            if image.offset < end and image.end > start:
                digest.update(image.digest)
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """The block hashes one replica has computed, least recently used first."""

    def __init__(self, *, block_tokens: int, capacity_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = max(1, capacity_blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hit_tokens(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Tokens of a prompt of `num_tokens` tokens (block hashes `hashes`) served from the
        cache: the leading cached blocks, at most num_tokens - 1 tokens. Touches nothing."""
        limit = min(len(hashes), max(0, num_tokens - 1) // self.block_tokens)
        hit = 0
        while hit < limit and hashes[hit] in self._blocks:
            hit += 1
        return hit * self.block_tokens

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Cache a scheduled prompt's blocks (hit ones become the most recently used)."""
        blocks = self._blocks
        for block_hash in hashes:
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

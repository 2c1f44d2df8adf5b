"""A deterministic stand-in tokenizer.

Text is split on whitespace, one token per word, and a word's id is a CRC of it, so the
same text always has the same ids on every machine and Python (no `hash()` salting). Each id
decodes to one pronounceable word with a leading space, so re-tokenizing generated text gives
back as many tokens as were generated.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


def text_to_token_ids(text: str, vocab_size: int) -> list[int]:
    return [zlib.crc32(word.encode("utf-8")) % vocab_size for word in text.split()]


@lru_cache(maxsize=262_144)
def token_text(token_id: int) -> str:
    """The text of one generated token: a space and a word spelled from the id's digits."""
    base = len(_SYLLABLES)
    parts = []
    value = token_id
    while True:
        value, digit = divmod(value, base)
        parts.append(_SYLLABLES[digit])
        if value == 0:
            break
    return " " + "".join(parts)

"""A deployment's engine profile: the engine parameters its replicas run with that a cost model
cannot tell (how many sequences a batch holds, how many tokens the KV cache holds, ...).

The cost model (capacity.pricing) says how much replica time a request costs on a saturated
replica; the what-if (simulation.whatif) also needs the engine's own limits to simulate one:
vLLM's `--max-num-seqs`, `--max-num-batched-tokens`, the KV cache's size in tokens (vLLM logs it
at start: "GPU KV cache size: N tokens") and `--max-model-len`. Stored as a JSON object on the
deployment (`Deployment.engine_profile`); every key is optional, a missing one takes vLLM's
default (or, for the context length, the model's). Validated here, for the API, the admin and
the services alike, with an error naming the key (`engine_profile.max_num_seqs`). No
database: plain data in, the stored profile or a DomainError out.
"""

from __future__ import annotations

import math
from typing import Any

from core.errors import DomainError

FIELD = "engine_profile"
# key -> (what it is, inclusive minimum, inclusive maximum)
KEYS: dict[str, tuple[str, int, int]] = {
    "max_num_seqs": ("vLLM's --max-num-seqs: sequences in one batch", 1, 65_536),
    "max_num_batched_tokens": (
        "vLLM's --max-num-batched-tokens: prompt tokens prefilled in one step",
        1,
        10_000_000,
    ),
    "kv_cache_tokens": ("tokens the KV cache holds (vLLM logs it at start)", 1, 1_000_000_000),
    "context_length": ("vLLM's --max-model-len: the longest sequence", 1, 100_000_000),
}
# vLLM's own defaults for its OpenAI server (V1, large GPUs); the KV cache has none: the
# emulator's default stands in for it.
DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "kv_cache_tokens": 200_000}


def validate_engine_profile(raw: Any) -> dict[str, int]:
    """The profile as stored (known keys, whole numbers in range), or a DomainError naming the
    key at fault; None or an empty value is the empty profile."""
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, dict):
        raise DomainError(
            f"{FIELD} must be a JSON object of engine parameters, got {type(raw).__name__}.",
            field=FIELD,
        )
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise DomainError(
            f"{FIELD}.{unknown[0]}: unknown engine parameter (known: {', '.join(KEYS)}).",
            field=f"{FIELD}.{unknown[0]}",
        )
    profile: dict[str, int] = {}
    for key, value in raw.items():
        what, low, high = KEYS[key]
        number = value
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            number = int(value)
        if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
            raise DomainError(
                f"{FIELD}.{key} ({what}) must be a whole number from {low:,} to {high:,}, "
                f"got {value!r}.",
                field=f"{FIELD}.{key}",
            )
        profile[key] = number
    kv, context = profile.get("kv_cache_tokens"), profile.get("context_length")
    if kv is not None and context is not None and kv < context:
        # vLLM refuses to start when one sequence of the full length cannot fit in its cache.
        raise DomainError(
            f"{FIELD}.kv_cache_tokens ({kv:,}) must hold at least one sequence of "
            f"context_length ({context:,}) tokens.",
            field=f"{FIELD}.kv_cache_tokens",
        )
    return profile


def effective_engine_profile(profile: dict[str, int], *, context_length: int) -> dict[str, int]:
    """Every parameter: the stored ones, else vLLM's defaults and the model's context length;
    the KV cache at least one full-length sequence."""
    values = DEFAULTS | {"context_length": context_length} | profile
    values["kv_cache_tokens"] = max(values["kv_cache_tokens"], values["context_length"])
    return values

"""Bytes of prompt text per input token, per model, calibrated against the engines' own counts.

A gateway has no tokenizer (docs/gateway-contract.md): before admission it estimates a
request's input tokens as its prompt bytes / the model's published `bytes_per_token`. Events
of requests that ran carry both numbers, the bytes the gateway saw (`prompt_bytes`) and the
input tokens the engine counted, and the minute rollups sum them. A model's calibration is
the ratio of those sums over the last PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS: the ratio of
sums, not a mean of ratios, so it estimates the model's total input tokens without bias
whatever the mix of short and long prompts. Chat templates add tokens the text does not show;
they are part of the ratio, as they are part of what a request costs.

Admission's estimate is corrected at reconcile anyway (the usage event settles the bucket
with the engine's count), so the calibration only makes the estimate closer beforehand.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Sum

from capacity.models import UsageMinute

# A calibration outside these bounds is a sender's bug, not a tokenizer: clamp to them.
MIN_BYTES_PER_TOKEN = 0.5
MAX_BYTES_PER_TOKEN = 64.0
# Publications run every tick and after every change; the ratio moves slowly.
REFRESH_SECONDS = 60.0

# (monotonic time computed, model id → bytes per token), per process.
_cache: list[tuple[float, dict[int, float]]] = []


def bytes_per_token_by_model(*, now: datetime) -> dict[int, float]:
    """Model id → calibrated bytes per token, for models with enough counted tokens; the
    others take PUBLICATION_BYTES_PER_TOKEN. Recomputed at most every REFRESH_SECONDS."""
    if _cache and time.monotonic() - _cache[0][0] < REFRESH_SECONDS:
        return _cache[0][1]
    since = now - timedelta(hours=settings.PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS)
    rows = (
        UsageMinute.objects.filter(minute__gte=since, prompt_bytes_input_tokens__gt=0)
        .values("served_model_id")
        .annotate(prompt_bytes=Sum("prompt_bytes"), tokens=Sum("prompt_bytes_input_tokens"))
        .order_by()
    )
    value = {
        row["served_model_id"]: min(
            MAX_BYTES_PER_TOKEN, max(MIN_BYTES_PER_TOKEN, row["prompt_bytes"] / row["tokens"])
        )
        for row in rows
        if row["tokens"] >= settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS
    }
    _cache[:] = [(time.monotonic(), value)]
    return value


def forget() -> None:
    """Drop the cached calibration (tests, and a publication that must be current)."""
    _cache.clear()

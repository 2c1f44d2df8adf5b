"""Bytes of prompt text per input token, per model, calibrated against the engines' own counts.

A gateway has no tokenizer (docs/gateway-contract.md): before admission it estimates a
request's input tokens as its prompt bytes / the model's published `bytes_per_token`. Events
of requests that ran carry both numbers, the bytes of text the gateway saw the engine tokenise
(`prompt_bytes`: text parts only, never an audio part's or any other part's `text`) and the
input tokens the engine counted. Chat templates add tokens the text does not show; they are
part of the ratio, as they are part of what a request costs.

No one customer moves it (issue 34, finding 5: one request of a 1.5 MB `text` field took a
model's published ratio from 4 to 64 in seconds, and every estimate, TPM limit and budget cap
ran 16x low). The calibration is a weighted median of the recent requests' own ratios (the
latest MAX_REQUESTS of the window, PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS): each request
weighs its input tokens, at most REQUEST_WEIGHT_CAP_TOKENS (one huge request is one vote), and
no customer outweighs all the others together (a customer that sends most of the traffic
cannot outvote the others alone). Before the model's engines counted
PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS tokens in the window, PUBLICATION_BYTES_PER_TOKEN
stands. `calibrations` says what each figure rests on (the planner's fleet page shows it).

Admission's estimate is corrected at reconcile anyway (the usage event settles the bucket
with the engine's count), so the calibration only makes the estimate closer beforehand.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Sum

from capacity.models import UsageEvent, UsageMinute

# A calibration outside these bounds is a sender's bug, not a tokenizer: clamp to them.
MIN_BYTES_PER_TOKEN = 0.5
MAX_BYTES_PER_TOKEN = 64.0
# Publications run every tick and after every change; the ratio moves slowly.
REFRESH_SECONDS = 60.0
# The requests the median is taken over (the latest of the window), per model.
MAX_REQUESTS = 5000
REQUEST_WEIGHT_CAP_TOKENS = 4096


@dataclass(frozen=True)
class Calibration:
    bytes_per_token: float
    requests: int  # the requests the median was taken over
    customers: int
    tokens: int  # the input tokens the engines counted for them


# (monotonic time computed, model id → calibration), per process.
_cache: list[tuple[float, dict[int, Calibration]]] = []


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The value at which half of the weight lies at or below (the lower median on a tie)."""
    pairs = sorted(zip(values, weights, strict=True))
    half = sum(weights) / 2.0
    running = 0.0
    for value, weight in pairs:
        running += weight
        if running >= half:
            return value
    return pairs[-1][0]


def calibrations(*, now: datetime) -> dict[int, Calibration]:
    """Model id → its calibration, for models whose engines counted enough tokens in the window;
    the others take PUBLICATION_BYTES_PER_TOKEN. Recomputed at most every REFRESH_SECONDS."""
    if _cache and time.monotonic() - _cache[0][0] < REFRESH_SECONDS:
        return _cache[0][1]
    since = now - timedelta(hours=settings.PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS)
    measured = UsageEvent.objects.filter(
        finished_at__gte=since, prompt_bytes__isnull=False, input_tokens__gt=0
    )
    # The models worth a look, from the rollups (which sum the same counts), not the events.
    counted = (
        UsageMinute.objects.filter(minute__gte=since, prompt_bytes_input_tokens__gt=0)
        .values("served_model_id")
        .annotate(tokens=Sum("prompt_bytes_input_tokens"))
        .filter(tokens__gte=settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS)
        .values_list("served_model_id", flat=True)
        .order_by()
    )
    value: dict[int, Calibration] = {}
    for model_id in counted:
        rows = list(
            measured.filter(served_model_id=model_id)
            .order_by("-finished_at")
            .values_list("customer_id", "prompt_bytes", "input_tokens")[:MAX_REQUESTS]
        )
        tokens = sum(row[2] for row in rows)
        if tokens < settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS:
            continue
        value[model_id] = _calibration(rows, tokens)
    _cache[:] = [(time.monotonic(), value)]
    return value


def _calibration(rows: list[tuple[int, int, int]], tokens: int) -> Calibration:
    weights = [float(min(input_tokens, REQUEST_WEIGHT_CAP_TOKENS)) for _, _, input_tokens in rows]
    by_customer: dict[int, float] = defaultdict(float)
    for (customer_id, _, _), weight in zip(rows, weights, strict=True):
        by_customer[customer_id] += weight
    total = sum(weights)
    if len(by_customer) > 1:
        # No customer outweighs all the others together: its requests weigh less, so it holds
        # at most half the vote (the lower median then stays with the others' ratios).
        scale = {c: min(1.0, (total - w) / w) if w else 1.0 for c, w in by_customer.items()}
        weights = [w * scale[row[0]] for row, w in zip(rows, weights, strict=True)]
    ratios = [prompt_bytes / input_tokens for _, prompt_bytes, input_tokens in rows]
    median = weighted_median(ratios, weights)
    return Calibration(
        bytes_per_token=min(MAX_BYTES_PER_TOKEN, max(MIN_BYTES_PER_TOKEN, median)),
        requests=len(rows),
        customers=len(by_customer),
        tokens=tokens,
    )


def bytes_per_token_by_model(*, now: datetime) -> dict[int, float]:
    """Model id → calibrated bytes per token (what gateways are published)."""
    return {model_id: c.bytes_per_token for model_id, c in calibrations(now=now).items()}


def forget() -> None:
    """Drop the cached calibration (tests, and a publication that must be current)."""
    _cache.clear()

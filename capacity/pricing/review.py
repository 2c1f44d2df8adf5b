"""What a new cost-model version would do to prices, before it prices anyone (DESIGN §1).

A fit that activated itself repriced all future usage without anyone looking, so prices could
drift night to night. A fit now activates itself only when, priced on the model's real request
shapes of the last REVIEW_WINDOW_DAYS days, it changes their total MU by at most
COST_MODEL_MAX_AUTO_CHANGE_PERCENT of what the active version charges for them
(`capacity.pricing.cost_models.cost_model_record`); otherwise it waits as a candidate, and the
planner's cost-model page shows the change per customer and per request shape before a planner
activates or rejects it.

Every request that ran in the window (a refused one cost nothing) is priced under both versions
by the currency's own code (`estimates.mu_per_request`); the events are grouped by exact shape
per customer in the database, so a week of traffic is one grouped query. Beyond
MAX_EVENTS_COMPARED events, a systematic one-in-k sample by id is priced instead: the change is
a ratio of two sums, which such a sample barely moves, and the comparison says it sampled.

On the model's reference GPU type these MU are what customers are charged. On another GPU type
they are that GPU's replica time in MU, so a change there is a change of what each of its
replicas mints (exchange.py), i.e. of sellable capacity; `prices_usage` tells them apart.

Without traffic in the window the shapes are the benchmark's own (the candidate's fit
residuals, else the active version's), and failing those the default mix; `basis` says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from django.db.models import Count
from django.db.models.functions import Mod
from django.utils import timezone

from accounts.models import Customer
from capacity.models import CostModel, Outcome, UsageEvent
from capacity.pricing.estimates import mu_per_request
from capacity.pricing.exchange import DEFAULT_MIX

REVIEW_WINDOW_DAYS = 7
# Above this many requests in the window, a one-in-k sample of them is priced: a review page
# then reads at most about this many rows, whatever the fleet's traffic.
MAX_EVENTS_COMPARED = 100_000

# Shape buckets of the per-shape table, by the API's token counts (input includes cached):
# each bucket holds four times the tokens of the one before.
INPUT_BUCKET_EDGES_TOKENS = (256, 1024, 4096, 16384)
OUTPUT_BUCKET_EDGES_TOKENS = (64, 256, 1024, 4096)

TRAFFIC = "traffic"
BENCHMARK_SHAPES = "benchmark_shapes"
DEFAULT_MIX_BASIS = "default_mix"


def signed_percent(share: float | None) -> str:
    """+7.2 %, for people; a change that cannot be stated as a share is "new"."""
    return "new" if share is None else f"{share * 100:+.1f} %"


def _tokens(count: int) -> str:
    return f"{count // 1024}k" if count >= 1024 and count % 1024 == 0 else str(count)


def _bucket_labels(edges: tuple[int, ...]) -> list[str]:
    labels = [f"< {_tokens(edges[0])}"]
    labels += [
        f"{_tokens(low)}–{_tokens(high)}" for low, high in zip(edges, edges[1:], strict=False)
    ]
    labels.append(f"≥ {_tokens(edges[-1])}")
    return labels


INPUT_BUCKET_LABELS = _bucket_labels(INPUT_BUCKET_EDGES_TOKENS)
OUTPUT_BUCKET_LABELS = _bucket_labels(OUTPUT_BUCKET_EDGES_TOKENS)


@dataclass(frozen=True)
class ChangeRow:
    """One customer's, one shape bucket's or all requests' MU under both versions."""

    key: str  # the customer's slug, or "input bucket/output bucket", or "total"
    label: str  # the customer's name, or the bucket in words
    requests: int
    current_mu: float
    candidate_mu: float

    @property
    def change(self) -> float | None:
        """(candidate − current) / current; None when only the candidate charges anything."""
        if self.current_mu > 0:
            return self.candidate_mu / self.current_mu - 1.0
        return 0.0 if self.candidate_mu <= 0 else None

    @property
    def change_text(self) -> str:
        return signed_percent(self.change)

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "label": self.label,
            "requests": self.requests,
            "current_mu": self.current_mu,
            "candidate_mu": self.candidate_mu,
            "change": self.change,
        }


@dataclass(frozen=True)
class PriceChange:
    """How `candidate` would price what `current` priced."""

    candidate_id: int
    candidate_version: int
    current_id: int
    current_version: int
    basis: str  # TRAFFIC, BENCHMARK_SHAPES or DEFAULT_MIX_BASIS
    window_days: int
    computed_at: datetime
    events_in_window: int  # requests that ran in the window (all of them, sampled or not)
    sample_one_in: int  # 1: every request was priced
    prices_usage: bool  # on the reference GPU type: these MU are customers' charges
    total: ChangeRow
    by_customer: tuple[ChangeRow, ...]  # biggest current charge first; empty without traffic
    by_shape: tuple[ChangeRow, ...]  # by input bucket, then output bucket; non-empty only

    @property
    def change(self) -> float | None:
        return self.total.change

    def exceeds(self, threshold: float) -> bool:
        """Whether the total moves by more than `threshold` (a share); a change that cannot
        be stated as a share (the current version charged nothing) always does."""
        change = self.change
        return change is None or abs(change) > threshold

    def describe(self) -> str:
        """The change and what it was measured on, in one phrase."""
        change = signed_percent(self.change)
        if self.basis == TRAFFIC:
            sample = (
                f", a one-in-{self.sample_one_in} sample of {self.events_in_window:,}"
                if self.sample_one_in > 1
                else ""
            )
            customers = len(self.by_customer)
            return (
                f"{change} on the last {self.window_days} days of traffic "
                f"({self.total.requests:,} requests of {customers} "
                f"customer{'s' * (customers != 1)}{sample})"
            )
        if self.basis == BENCHMARK_SHAPES:
            return (
                f"{change} on the benchmark's {self.total.requests} shapes, each once "
                f"(no traffic in the last {self.window_days} days)"
            )
        return (
            f"{change} on a typical request of {round(DEFAULT_MIX.input_tokens)} input and "
            f"{round(DEFAULT_MIX.output_tokens)} output tokens (no traffic in the last "
            f"{self.window_days} days and no benchmark shapes)"
        )

    def summary(self) -> dict:
        """What is stored on the version: totals only, never a customer's figures (every
        signed-in caller reads cost models)."""
        changes = [row.change for row in self.by_customer]
        known = [change for change in changes if change is not None]
        return {
            "basis": self.basis,
            "compared_with_id": self.current_id,
            "compared_with_version": self.current_version,
            "window_days": self.window_days,
            "computed_at": self.computed_at.isoformat(),
            "requests": self.total.requests,
            "events_in_window": self.events_in_window,
            "sample_one_in": self.sample_one_in,
            "customers": len(self.by_customer),
            "prices_usage": self.prices_usage,
            "current_mu": self.total.current_mu,
            "candidate_mu": self.total.candidate_mu,
            "change": self.change,
            "largest_customer_change": max(known, key=abs) if known else None,
            "description": self.describe(),
        }

    def as_dict(self) -> dict:
        return self.summary() | {
            "total": self.total.as_dict(),
            "by_customer": [row.as_dict() for row in self.by_customer],
            "by_shape": [row.as_dict() for row in self.by_shape],
        }


@dataclass(frozen=True)
class _Requests:
    """Requests grouped by exact shape: the API's token counts and how many of each."""

    customer_ids: np.ndarray  # -1 for benchmark shapes (no customer)
    input_tokens: np.ndarray
    cached_input_tokens: np.ndarray
    output_tokens: np.ndarray
    images: np.ndarray
    counts: np.ndarray

    def mu(self, cost_model: CostModel) -> np.ndarray:
        """The MU of each group: one request's price × how many."""
        return (
            mu_per_request(
                cost_model,
                input_tokens=self.input_tokens,
                cached_input_tokens=self.cached_input_tokens,
                output_tokens=self.output_tokens,
                images=self.images,
            )
            * self.counts
        )


def _requests(rows: list[tuple[int, int, int, int, int, int]]) -> _Requests:
    columns = np.array(rows, dtype=np.int64).reshape(-1, 6)
    return _Requests(*(columns[:, index] for index in range(6)))


def _traffic(
    candidate: CostModel, *, since: datetime, until: datetime
) -> tuple[_Requests | None, int, int]:
    """(the window's requests that ran, grouped; how many ran; the sampling step)."""
    events = UsageEvent.objects.filter(
        served_model_id=candidate.served_model_id, started_at__gte=since, started_at__lt=until
    ).exclude(outcome=Outcome.REFUSED)
    events_in_window = events.count()
    if not events_in_window:
        return None, 0, 1
    step = math.ceil(events_in_window / MAX_EVENTS_COMPARED)
    if step > 1:
        events = events.alias(sample=Mod("id", step)).filter(sample=0)
    rows = list(
        events.order_by()
        .values("customer_id", "input_tokens", "cached_input_tokens", "output_tokens", "images")
        .annotate(requests=Count("id"))
        .values_list(
            "customer_id",
            "input_tokens",
            "cached_input_tokens",
            "output_tokens",
            "images",
            "requests",
        )
    )
    return (_requests(rows) if rows else None), events_in_window, step


def _benchmark_shapes(candidate: CostModel, current: CostModel) -> _Requests | None:
    """The shapes the candidate was fitted on, else those of the current version; each once."""
    for residuals in (candidate.residuals, current.residuals):
        rows = [
            (
                -1,
                int(r["input_tokens"]) + int(r.get("cached_input_tokens", 0) or 0),
                int(r.get("cached_input_tokens", 0) or 0),
                int(r["output_tokens"]),
                int(r.get("images", 0) or 0),
                1,
            )
            for r in residuals or []
        ]
        if rows:
            return _requests(rows)
    return None


def _default_mix() -> _Requests:
    shape = DEFAULT_MIX.rounded()
    return _requests(
        [(-1, shape.total_input_tokens, shape.cached_input_tokens, shape.output_tokens, 0, 1)]
    )


def _sum_by(keys: np.ndarray, *values: np.ndarray) -> dict[int, tuple[float, ...]]:
    """Per distinct key, the sum of each of `values` (one pass each, whatever the keys)."""
    unique, inverse = np.unique(keys, return_inverse=True)
    columns = [
        np.bincount(inverse, weights=np.asarray(value, dtype=float), minlength=len(unique))
        for value in values
    ]
    return {
        int(key): tuple(float(column[index]) for column in columns)
        for index, key in enumerate(unique)
    }


def price_change(
    *, candidate: CostModel, current: CostModel, now: datetime | None = None
) -> PriceChange:
    """Price the last REVIEW_WINDOW_DAYS days of the model's requests under `current` and
    `candidate` (two versions of one model, usually of one GPU type and size)."""
    now = now or timezone.now()
    since = now - timedelta(days=REVIEW_WINDOW_DAYS)
    requests, events_in_window, step = _traffic(candidate, since=since, until=now)
    basis = TRAFFIC
    if requests is None:
        requests = _benchmark_shapes(candidate, current)
        basis = BENCHMARK_SHAPES
    if requests is None:
        requests = _default_mix()
        basis = DEFAULT_MIX_BASIS
    current_mu = requests.mu(current)
    candidate_mu = requests.mu(candidate)

    by_customer: list[ChangeRow] = []
    if basis == TRAFFIC:
        sums = _sum_by(requests.customer_ids, requests.counts, current_mu, candidate_mu)
        names = {
            pk: (slug, name)
            for pk, slug, name in Customer.objects.filter(pk__in=list(sums)).values_list(
                "pk", "slug", "name"
            )
        }
        by_customer = [
            ChangeRow(
                key=names[pk][0],
                label=names[pk][1],
                requests=round(count),
                current_mu=current_sum,
                candidate_mu=candidate_sum,
            )
            for pk, (count, current_sum, candidate_sum) in sums.items()
        ]
        by_customer.sort(key=lambda row: (-row.current_mu, row.key))

    input_bucket = np.digitize(requests.input_tokens, INPUT_BUCKET_EDGES_TOKENS)
    output_bucket = np.digitize(requests.output_tokens, OUTPUT_BUCKET_EDGES_TOKENS)
    bucket = input_bucket * len(OUTPUT_BUCKET_LABELS) + output_bucket
    by_shape = []
    for key, (count, current_sum, candidate_sum) in sorted(
        _sum_by(bucket, requests.counts, current_mu, candidate_mu).items()
    ):
        input_index, output_index = divmod(key, len(OUTPUT_BUCKET_LABELS))
        input_label = INPUT_BUCKET_LABELS[input_index]
        output_label = OUTPUT_BUCKET_LABELS[output_index]
        by_shape.append(
            ChangeRow(
                key=f"{input_label}/{output_label}",
                label=f"input {input_label}, output {output_label} tokens",
                requests=round(count),
                current_mu=current_sum,
                candidate_mu=candidate_sum,
            )
        )

    total = ChangeRow(
        key="total",
        label="all requests",
        requests=int(requests.counts.sum()),
        current_mu=float(current_mu.sum()),
        candidate_mu=float(candidate_mu.sum()),
    )
    return PriceChange(
        candidate_id=candidate.pk,
        candidate_version=candidate.version,
        current_id=current.pk,
        current_version=current.version,
        basis=basis,
        window_days=REVIEW_WINDOW_DAYS,
        computed_at=now,
        events_in_window=events_in_window,
        sample_one_in=step,
        prices_usage=candidate.gpu_type_id == candidate.served_model.reference_gpu_type_id,
        total=total,
        by_customer=tuple(by_customer),
        by_shape=tuple(by_shape),
    )

"""What a new cost-model version would do to prices, before it prices anyone
(docs/design.md#versions).

A fit that activated itself repriced all future usage without anyone looking, so prices could
drift night to night. A fit now activates itself only when, priced on the model's real request
shapes of the last REVIEW_WINDOW_DAYS days, it changes their total MU by at most
COST_MODEL_MAX_AUTO_CHANGE_PERCENT, and each customer's too (`auto_activation_review`, which
`capacity.repricing.services.cost_model_record` asks); otherwise it waits as a candidate, and
the planner's cost-model page shows the change per customer and per request shape before a
planner activates or rejects it.

The limit cannot be ratcheted (issue 33): three fits of +4 % each, each within 5 % of the one
before, must not add up to +12.5 % unreviewed. So a fit is measured from a *baseline* as well as
from the active version, and must be within the limit of both:

- "The last version a planner approved": the version of the same model, GPU type and size whose
  `approved_by` (who put it in force, `cost_model_activate`) is a person or a key, i.e. neither
  empty nor a "system:…" actor ("system:auto" is a fit that activated itself; any other system
  actor is a job, not a review), the latest by `activated_at`.
- "The one in force 30 days ago": the version whose activation interval, `activated_at` to
  `retired_at` (or still active), covers now − BASELINE_DAYS. A version holds only its latest
  interval (a retired version activated again forgets the earlier one; the audit log keeps
  every activation). When none was in force then, as for a model younger than that, it is the
  first version that came into force since: otherwise a new model's automatic versions could
  ratchet for its first 30 days, measured each time from the one before.
- Of the two, whichever came into force later (`activated_at`): a planner's approval resets
  the baseline, and without one the baseline moves on no faster than 30 days at a time, so
  automatic drift is at most the limit in any 30 days.
- With neither (no version of the group ever had an activation time, which only versions
  written outside the services lack), the active version, as before.
- Without an active version the fit reprices nothing that is priced, and is not compared.

The limit applies to the total and to each customer's charge in the window, both ways (a charge
falling by 10 % is as much a change as one rising), for the customers with at least
COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS requests that ran in it (under sampling, the sampled
count × the sampling step): a customer who sent three requests of an odd shape would otherwise
hold every fit, while their bill moves by little. Off the model's reference GPU type nothing is
a charge (see below), so only the total is limited there.

Every request that ran in the window (a refused one cost nothing) is priced under the
versions compared by the currency's own code (`estimates.mu_per_request`); the events are
grouped by exact shape per customer in the database, so a week of traffic is one grouped
query, whatever the number of versions it is priced under. Beyond MAX_EVENTS_COMPARED events,
a systematic one-in-k sample by id is priced instead: the change is a ratio of two sums, which
such a sample barely moves, and the comparison says it sampled.

On the model's reference GPU type these MU are what customers are charged. On another GPU type
they are that GPU's replica time in MU, so a change there is a change of what each of its
replicas mint (exchange.py), i.e. of sellable capacity; `prices_usage` tells them apart.

Without traffic in the window the shapes are the benchmark's own (the candidate's fit
residuals, else the compared version's), and failing those the default mix; `basis` says which.

Works the same on PostgreSQL and SQLite: the baseline is two indexed reads of one group's
versions, the traffic one grouped query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from django.conf import settings
from django.db.models import Count, Q, Value
from django.db.models.functions import Coalesce, Mod
from django.utils import timezone

from accounts.models import Customer
from capacity.models import CostModel, Outcome, UsageEvent
from capacity.pricing.estimates import mu_per_request
from capacity.pricing.exchange import DEFAULT_MIX

REVIEW_WINDOW_DAYS = 7
# A fit is measured from the version in force this many days ago, unless a planner approved one
# since: automatic changes add up to at most COST_MODEL_MAX_AUTO_CHANGE_PERCENT in that time.
BASELINE_DAYS = 30
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

# What a baseline is (Baseline.kind).
APPROVED = "approved"
ACTIVE_30_DAYS_AGO = "active_30_days_ago"
FIRST_IN_FORCE = "first_in_force"
ACTIVE = "active"

# Actors that are no one's review: "system:auto" (a fit that activated itself), jobs.
SYSTEM_ACTOR_PREFIX = "system:"


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
        """The totals, for the version's stored review (`AutoActivationReview.summary` adds
        the baseline and the customers over the limit); the per-customer and per-shape rows
        are read live (GET …/price-change/, the planner's page)."""
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
    # Engine requests and sequences of each (a list of prompts, `n`): 1 for most.
    prompts: np.ndarray | None = None
    sequences: np.ndarray | None = None

    def mu(self, cost_model: CostModel) -> np.ndarray:
        """The MU of each group: one request's price × how many."""
        several = self.prompts is not None and bool(
            (self.prompts > 1).any() or (self.sequences > 1).any()
        )
        return (
            mu_per_request(
                cost_model,
                input_tokens=self.input_tokens,
                cached_input_tokens=self.cached_input_tokens,
                output_tokens=self.output_tokens,
                images=self.images,
                prompts=self.prompts if several else None,
                sequences=self.sequences if several else None,
            )
            * self.counts
        )


def _requests(rows: list[tuple[int, ...]]) -> _Requests:
    """Rows of (customer, input, cached, output, images, count[, prompts, sequences])."""
    columns = np.array([(*row, 1, 1)[:8] for row in rows], dtype=np.int64).reshape(-1, 8)
    return _Requests(*(columns[:, index] for index in range(8)))


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
        .annotate(
            request_prompts=Coalesce("prompts", Value(1)),
            request_sequences=Coalesce("sequences", Value(1)),
        )
        .values(
            "customer_id",
            "input_tokens",
            "cached_input_tokens",
            "output_tokens",
            "images",
            "request_prompts",
            "request_sequences",
        )
        .annotate(requests=Count("id"))
        .values_list(
            "customer_id",
            "input_tokens",
            "cached_input_tokens",
            "output_tokens",
            "images",
            "requests",
            "request_prompts",
            "request_sequences",
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
    (change,) = price_changes(candidate=candidate, compared_with=[current], now=now)
    return change


def price_changes(
    *, candidate: CostModel, compared_with: list[CostModel], now: datetime | None = None
) -> list[PriceChange]:
    """`price_change` from each of `compared_with` (versions of the candidate's model), on the
    same requests: the window's traffic is read once, whatever the number of versions."""
    now = now or timezone.now()
    since = now - timedelta(days=REVIEW_WINDOW_DAYS)
    requests, events_in_window, step = _traffic(candidate, since=since, until=now)
    basis = TRAFFIC
    if requests is None:
        requests = _benchmark_shapes(candidate, compared_with[0])
        basis = BENCHMARK_SHAPES
    if requests is None:
        requests = _default_mix()
        basis = DEFAULT_MIX_BASIS
    candidate_mu = requests.mu(candidate)
    names: dict[int, tuple[str, str]] = {}
    if basis == TRAFFIC:
        names = {
            pk: (slug, name)
            for pk, slug, name in Customer.objects.filter(
                pk__in=np.unique(requests.customer_ids).tolist()
            ).values_list("pk", "slug", "name")
        }
    return [
        _compared(
            candidate,
            current,
            requests=requests,
            candidate_mu=candidate_mu,
            basis=basis,
            names=names,
            now=now,
            events_in_window=events_in_window,
            step=step,
        )
        for current in compared_with
    ]


def _compared(
    candidate: CostModel,
    current: CostModel,
    *,
    requests: _Requests,
    candidate_mu: np.ndarray,
    basis: str,
    names: dict[int, tuple[str, str]],
    now: datetime,
    events_in_window: int,
    step: int,
) -> PriceChange:
    current_mu = requests.mu(current)

    by_customer: list[ChangeRow] = []
    if basis == TRAFFIC:
        sums = _sum_by(requests.customer_ids, requests.counts, current_mu, candidate_mu)
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


# --- The baseline and the decision of an automatic activation (issue 33) ----------------------


@dataclass(frozen=True)
class Baseline:
    """The version a new fit is measured from besides the active one (module docstring)."""

    cost_model: CostModel
    kind: str  # APPROVED, ACTIVE_30_DAYS_AGO, FIRST_IN_FORCE or ACTIVE
    is_active: bool  # it is also the active version

    def describe(self) -> str:
        """For people: v3, the last version a planner approved (user:ann on 2026-05-02)."""
        return f"v{self.cost_model.version}, {self.why()}"

    def why(self) -> str:
        """What makes it the baseline, in words."""
        cost_model = self.cost_model
        why = {
            APPROVED: (
                "the last version a planner approved "
                f"({cost_model.approved_by} on {_day(cost_model.activated_at)})"
            ),
            ACTIVE_30_DAYS_AGO: f"the version in force {BASELINE_DAYS} days ago",
            FIRST_IN_FORCE: f"the first version in force in the last {BASELINE_DAYS} days",
            ACTIVE: "the active version, no version's activation being on record",
        }[self.kind]
        if self.is_active and self.kind != ACTIVE:
            why = f"the active version and {why}"
        return why


def _day(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d") if moment is not None else "an unrecorded day"


def review_baseline(
    *, cost_model: CostModel, active: CostModel, now: datetime | None = None
) -> Baseline:
    """What `cost_model` (a version not in force) is measured from besides `active`, the
    active version of its group: the later to come into force of the last version a planner
    approved and the version in force BASELINE_DAYS ago (else the first in force since);
    failing both, `active` itself."""
    now = now or timezone.now()
    versions = CostModel.objects.filter(
        served_model_id=cost_model.served_model_id,
        gpu_type_id=cost_model.gpu_type_id,
        gpus_per_replica=cost_model.gpus_per_replica,
        activated_at__isnull=False,
        activated_at__lte=now,
    ).exclude(pk=cost_model.pk)
    latest_first = ("-activated_at", "-version")
    approved = (
        versions.exclude(approved_by="")
        .exclude(approved_by__startswith=SYSTEM_ACTOR_PREFIX)
        .order_by(*latest_first)
        .first()
    )
    start = now - timedelta(days=BASELINE_DAYS)
    dated: CostModel | None = (
        versions.filter(activated_at__lte=start)
        .filter(Q(retired_at__isnull=True) | Q(retired_at__gt=start))
        .order_by(*latest_first)
        .first()
    )
    dated_kind = ACTIVE_30_DAYS_AGO
    if dated is None:
        dated = versions.filter(activated_at__gt=start).order_by("activated_at", "version").first()
        dated_kind = FIRST_IN_FORCE
    # The later to come into force wins; the same version is named for the planner's approval.
    chosen = [
        (found, kind)
        for found, kind in ((approved, APPROVED), (dated, dated_kind))
        if found is not None
    ]
    if not chosen:
        return Baseline(cost_model=active, kind=ACTIVE, is_active=True)
    baseline, kind = max(
        chosen, key=lambda pair: (pair[0].activated_at, pair[0].version, pair[1] == APPROVED)
    )
    return Baseline(cost_model=baseline, kind=kind, is_active=baseline.pk == active.pk)


@dataclass(frozen=True)
class OverLimit:
    """A customer whose charge a fit moves by more than the limit, from one compared version
    (the one it moves it most from)."""

    row: ChangeRow
    compared_with_version: int

    def as_dict(self) -> dict:
        return {
            "key": self.row.key,
            "label": self.row.label,
            "requests": self.row.requests,
            "change": self.row.change,
            "compared_with_version": self.compared_with_version,
        }


# At most this many customers over the limit are named in a reason (review_reason holds 500
# characters: fewer when they do not fit); the stored review and the planner's page list all.
CUSTOMERS_NAMED = 3


@dataclass(frozen=True)
class AutoActivationReview:
    """Whether a new fit may activate itself as far as prices go, and why, in words."""

    against_active: PriceChange
    against_baseline: PriceChange  # the same comparison when the baseline is the active one
    baseline: Baseline
    max_change: float
    min_customer_requests: int
    customers_checked: int  # customers of at least min_customer_requests in the window
    over_limit: tuple[OverLimit, ...]  # largest change first

    @property
    def holds(self) -> bool:
        """Whether it must wait for a planner."""
        return (
            self.against_baseline.exceeds(self.max_change)
            or self.against_active.exceeds(self.max_change)
            or bool(self.over_limit)
        )

    def describe(self, *, max_chars: int | None = None) -> str:
        """Why it activates itself or waits, in one sentence (no final full stop). With
        `max_chars`, fewer customers over the limit are named (at least one) until it fits:
        a cut sentence would lose what it was measured from."""
        for named in range(CUSTOMERS_NAMED, 0, -1):
            sentence = self._sentence(customers_named=named)
            if max_chars is None or len(sentence) <= max_chars:
                break
        return sentence

    def _sentence(self, *, customers_named: int) -> str:
        limit = f"COST_MODEL_MAX_AUTO_CHANGE_PERCENT ({self.max_change * 100:g} %)"
        baseline = self.against_baseline
        parts = [
            f"v{baseline.current_version} → v{baseline.candidate_version} moves prices by "
            f"{baseline.describe()}, {_verdict(baseline, self.max_change)} {limit}"
        ]
        if not self.baseline.is_active:
            active = self.against_active
            parts.append(
                f"from the active v{active.current_version}: {signed_percent(active.change)}, "
                f"{_verdict(active, self.max_change)} it"
            )
        customers = self._customers(named=customers_named)
        if customers:
            parts.append(customers)
        parts.append(f"measured from {self.baseline.describe()}")
        return "; ".join(parts)

    def _customers(self, *, named: int) -> str:
        if _charges_not_compared(self.against_baseline):
            return ""
        who = f"a customer with at least {self.min_customer_requests:,} requests in the window"
        if self.over_limit:
            moves = [
                f"{entry.row.key}'s {'charge moves ' if index == 0 else ''}by "
                f"{entry.row.change_text}{self._from(entry)} ({entry.row.requests:,} requests)"
                for index, entry in enumerate(self.over_limit[:named])
            ]
            more = len(self.over_limit) - named
            if more > 0:
                moves.append(f"and those of {more} more customer{'s' * (more != 1)}")
            return f"{', '.join(moves)}, more than it allows {who}"
        if not self.customers_checked:
            return f"no customer had at least {self.min_customer_requests:,} requests in the window"
        return f"every charge of {who} is within it too"

    def _from(self, entry: OverLimit) -> str:
        # Only said when two versions were compared.
        return "" if self.baseline.is_active else f" from v{entry.compared_with_version}"

    def summary(self) -> dict:
        """What is stored on the version (`price_change`): the totals from the active version
        as `PriceChange.summary`, the baseline, and the customers over the limit by name (the
        stored review is read only by planners and platform services, like GET
        …/price-change/)."""
        return self.against_active.summary() | {
            "baseline": {
                "kind": self.baseline.kind,
                "id": self.baseline.cost_model.pk,
                "version": self.baseline.cost_model.version,
                "activated_at": (
                    self.baseline.cost_model.activated_at.isoformat()
                    if self.baseline.cost_model.activated_at
                    else None
                ),
                "approved_by": self.baseline.cost_model.approved_by,
                "is_active": self.baseline.is_active,
                "change": self.against_baseline.change,
                "why": self.baseline.why(),
                "description": self.baseline.describe(),
            },
            "max_change": self.max_change,
            "min_customer_requests": self.min_customer_requests,
            "customers_over_limit": [entry.as_dict() for entry in self.over_limit],
        }

    def audit(self) -> dict:
        """The review in an audit entry's `after`."""
        return {
            "price_change": self.against_active.change,
            "baseline_version": self.baseline.cost_model.version,
            "price_change_from_baseline": self.against_baseline.change,
            "customers_over_limit": [entry.row.key for entry in self.over_limit],
        }


def _verdict(change: PriceChange, max_change: float) -> str:
    return "more than" if change.exceeds(max_change) else "within"


def _charges_not_compared(change: PriceChange) -> bool:
    """Whether no customer's charge is compared: without traffic there are no customers, and
    off the reference GPU type the MU are replica time, nobody's charge."""
    return change.basis != TRAFFIC or not change.prices_usage


def _over_limit(
    changes: list[PriceChange], *, max_change: float, min_customer_requests: int
) -> tuple[int, tuple[OverLimit, ...]]:
    """(how many customers the limit applies to, those over it from any of `changes`)."""
    checked: set[str] = set()
    worst: dict[str, OverLimit] = {}
    for change in changes:
        if _charges_not_compared(change):
            continue
        for row in change.by_customer:
            # Under sampling a row counts the sampled requests: scale back to the window's.
            if row.requests * change.sample_one_in < min_customer_requests:
                continue
            checked.add(row.key)
            if row.change is not None and abs(row.change) <= max_change:
                continue
            known = worst.get(row.key)
            if known is None or _size(row.change) > _size(known.row.change):
                worst[row.key] = OverLimit(row=row, compared_with_version=change.current_version)
    over = sorted(worst.values(), key=lambda entry: (-_size(entry.row.change), entry.row.key))
    return len(checked), tuple(over)


def _size(change: float | None) -> float:
    """How far a change is from none; a change that is not a share (only the candidate
    charges) is the largest."""
    return math.inf if change is None else abs(change)


def auto_activation_review(
    *, candidate: CostModel, active: CostModel, now: datetime | None = None
) -> AutoActivationReview:
    """The price review of a new fit for activating itself: from the active version and from
    the baseline, in total and per customer, against COST_MODEL_MAX_AUTO_CHANGE_PERCENT and
    COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS."""
    now = now or timezone.now()
    baseline = review_baseline(cost_model=candidate, active=active, now=now)
    compared = [active] if baseline.is_active else [active, baseline.cost_model]
    changes = price_changes(candidate=candidate, compared_with=compared, now=now)
    max_change = settings.COST_MODEL_MAX_AUTO_CHANGE
    min_customer_requests = settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS
    # The baseline's comparison first, so a customer's worst change names it on a tie.
    checked, over = _over_limit(
        changes[::-1], max_change=max_change, min_customer_requests=min_customer_requests
    )
    return AutoActivationReview(
        against_active=changes[0],
        against_baseline=changes[-1],
        baseline=baseline,
        max_change=max_change,
        min_customer_requests=min_customer_requests,
        customers_checked=checked,
        over_limit=over,
    )

"""The latency SLA of a rate card: a TTFT objective for guaranteed requests and a table from
attainment to credit.

Attainment is, per customer, model and rate card in force, the share of the month's guaranteed
requests that ran (refused ones earn the refusal credit instead) whose first token came within
the objective, as the customer experienced it and a gateway measured it
(capacity.metering.selectors.guaranteed_ttft_counts): from the end of any hold for a cold start,
plus the hold for a customer whose reservation keeps the model warm (it paid not to wait),
without it for one that declined keep-warm (it accepted the cold starts). Requests with no
`ttft_ms` are not in it either way, nor are those a customer's own key reported (no
self-reported latency earns a credit), nor non-streamed ones (a whole answer's first byte is its
end): they are counted and shown, never guessed. The credit is the share of that model's
commitment under that card which the first tier the attainment falls below names (the tiers
credit more the lower they reach).

Every invoice line of a commitment under a card with an SLA is answered by one line of its
latency SLA, with the attainment and the counts as evidence: the credit when one is due, else a
line of kind `latency_sla` for 0.00 (the SLA met, or nothing to measure: no guaranteed request
reported a TTFT), so the customer sees the attainment and the requests without a TTFT every
month, in the JSON, the CSV and the PDF alike.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction

from billing.models import InvoiceLine
from billing.money import money
from capacity.metering.selectors import TtftCounts, guaranteed_ttft_counts
from core.errors import DomainError

MAX_TTFT_OBJECTIVE_MS = 3_600_000  # ingestion refuses a ttft_ms above an hour
MAX_TIERS = 10
TIER_KEYS = ("below_attainment_percent", "credit_percent")


def latency_sla_clean(*, ttft_objective_ms, latency_credit_tiers) -> list[dict]:
    """The tiers as stored (highest attainment first), or a DomainError naming the field.
    An objective and its tiers come together: one without the other credits nothing."""
    tiers = latency_credit_tiers if latency_credit_tiers is not None else []
    field = "latency_credit_tiers"
    if ttft_objective_ms is not None and (
        isinstance(ttft_objective_ms, bool)
        or not isinstance(ttft_objective_ms, int)
        or not 1 <= ttft_objective_ms <= MAX_TTFT_OBJECTIVE_MS
    ):
        raise DomainError(
            f"must be a whole number of ms from 1 to {MAX_TTFT_OBJECTIVE_MS:,}.",
            field="ttft_objective_ms",
        )
    if not isinstance(tiers, list):
        raise DomainError(
            'must be a list like [{"below_attainment_percent": 99, "credit_percent": 10}].',
            field=field,
        )
    if tiers and ttft_objective_ms is None:
        raise DomainError("Tiers need a TTFT objective to measure against.", field=field)
    if ttft_objective_ms is not None and not tiers:
        raise DomainError(
            "An objective needs at least one tier: say what missing it credits.", field=field
        )
    if len(tiers) > MAX_TIERS:
        raise DomainError(f"may hold at most {MAX_TIERS} tiers.", field=field)
    cleaned = []
    for index, tier in enumerate(tiers):
        if not isinstance(tier, dict) or set(tier) != set(TIER_KEYS):
            raise DomainError(
                f"tier {index} must hold exactly below_attainment_percent and credit_percent.",
                field=field,
            )
        for key in TIER_KEYS:
            value = tier[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise DomainError(f"tier {index}: {key} must be a number.", field=field)
            if not 0 < value <= 100:
                raise DomainError(
                    f"tier {index}: {key} must be above 0 and at most 100.", field=field
                )
        cleaned.append({key: tier[key] for key in TIER_KEYS})
    cleaned.sort(key=lambda tier: tier["below_attainment_percent"], reverse=True)
    for higher, lower in zip(cleaned, cleaned[1:], strict=False):
        if higher["below_attainment_percent"] == lower["below_attainment_percent"]:
            raise DomainError(
                f"two tiers start below {lower['below_attainment_percent']} %.", field=field
            )
        if lower["credit_percent"] <= higher["credit_percent"]:
            raise DomainError(
                f"the tier below {lower['below_attainment_percent']} % must credit more than "
                f"the one below {higher['below_attainment_percent']} %.",
                field=field,
            )
    return cleaned


def credit_tier(tiers: list[dict], counts: TtftCounts) -> dict | None:
    """The tier this attainment falls into: the lowest threshold it is below (tiers credit
    more the lower they reach); None when it meets every threshold or nothing was counted.
    Exact: within / counted against the threshold, with no rounding."""
    if counts.counted == 0:
        return None
    attainment = Fraction(counts.within * 100, counts.counted)
    below = [t for t in tiers if attainment < Fraction(str(t["below_attainment_percent"]))]
    return min(below, key=lambda t: t["below_attainment_percent"]) if below else None


@dataclass(frozen=True)
class _Window:
    served_model_id: int
    card: object  # billing.models.RateCard
    starts_at: object
    ends_at: object


@dataclass
class SlaCounts:
    """What latency_counts found: each customer's counts per (model, card) with an SLA, and
    the window of every such (model, card) in the period."""

    counts: dict[tuple[int, int, int], TtftCounts] = field(default_factory=dict)
    windows: dict[tuple[int, int], _Window] = field(default_factory=dict)


def latency_counts(segments, reserved_customers: dict[int, set[int]]) -> SlaCounts:
    """(customer, model, card) -> TtftCounts for every rate-card segment with a latency SLA:
    one grouped query per segment, over the customers with a reservation of the model."""
    found = SlaCounts()
    for model_id, model_segments in segments.items():
        customers = reserved_customers.get(model_id)
        if not customers:
            continue
        for rate in model_segments:
            card = rate.card
            if card.ttft_objective_ms is None or not card.latency_credit_tiers:
                continue
            found.windows[(model_id, card.pk)] = _Window(
                model_id, card, rate.starts_at, rate.ends_at
            )
            by_customer = guaranteed_ttft_counts(
                served_model_id=model_id,
                customer_ids=sorted(customers),
                start=rate.starts_at,
                end=rate.ends_at,
                objective_ms=card.ttft_objective_ms,
            )
            for customer_id, customer_counts in by_customer.items():
                found.counts[(customer_id, model_id, card.pk)] = customer_counts
    return found


NOTHING_COUNTED = TtftCounts(0, 0, 0)


def _not_counted(ttft: TtftCounts) -> str:
    """ "; 12 without a TTFT, not counted (10 not streamed, 2 self-reported)", or ""."""
    if not ttft.without_ttft:
        return ""
    why = []
    if ttft.not_streamed:
        why.append(f"{ttft.not_streamed:,} not streamed")
    if ttft.self_reported:
        why.append(f"{ttft.self_reported:,} self-reported")
    return f"; {ttft.without_ttft:,} without a TTFT, not counted" + (
        f" ({', '.join(why)})" if why else ""
    )


def _evidence(ttft: TtftCounts) -> dict:
    """What every SLA line says it did not count, beside its tier and amount."""
    return {
        "requests_without_ttft": ttft.without_ttft,
        "requests_not_streamed": ttft.not_streamed,
        "requests_self_reported": ttft.self_reported,
    }


def _report_line(model_id: int, window: _Window, ttft: TtftCounts, commitment) -> InvoiceLine:
    """The SLA's line when no credit is due: what was measured, for 0.00."""
    objective = window.card.ttft_objective_ms
    tiers = window.card.latency_credit_tiers
    first = max(t["below_attainment_percent"] for t in tiers)
    attainment = round(ttft.within * 100 / ttft.counted, 3) if ttft.counted else None
    if attainment is not None:
        description = (
            f"Latency SLA met: {attainment:.3f} % of {ttft.counted:,} guaranteed requests had "
            f"their first token within {objective:,} ms (credits start below {first:g} %)"
        )
    elif ttft.without_ttft:
        description = (
            f"Latency SLA not measured: no guaranteed request reported a TTFT (objective "
            f"{objective:,} ms)"
        )
    else:
        description = f"Latency SLA: no guaranteed requests ran (objective {objective:,} ms)"
    description += _not_counted(ttft) + "; no credit due"
    return InvoiceLine(
        kind=InvoiceLine.Kind.LATENCY_SLA,
        served_model_id=model_id,
        rate_card=window.card,
        description=description[:300],
        starts_at=window.starts_at,
        ends_at=window.ends_at,
        quantity=Decimal(ttft.counted),
        unit="requests with a TTFT",
        unit_price=Decimal(0),
        amount=Decimal("0.00"),
        evidence={
            "sla": "ttft",
            "ttft_objective_ms": objective,
            "attainment_percent": attainment,
            "requests_counted": ttft.counted,
            "requests_within_objective": ttft.within,
            **_evidence(ttft),
            "below_attainment_percent": None,
            "credit_percent": 0,
            "commitment": str(commitment),
        },
    )


def latency_credit_lines(customer_id: int, found: SlaCounts, commitment_lines) -> list[InvoiceLine]:
    """The customer's latency SLA lines: per model and card with an SLA, a credit of the tier's
    share of the commitment billed under the card when the attainment fell below a tier, else
    a 0.00 line of kind `latency_sla` with the same evidence (no credit due)."""
    committed: dict[tuple[int, int], Decimal] = defaultdict(Decimal)
    for line in commitment_lines:
        if line.kind == InvoiceLine.Kind.COMMITMENT:
            committed[(line.served_model_id, line.rate_card.pk)] += line.amount
    lines = []
    for (model_id, card_id), commitment in sorted(committed.items()):
        window = found.windows.get((model_id, card_id))
        if window is None or commitment <= 0:
            continue  # no SLA on the card
        ttft = found.counts.get((customer_id, model_id, card_id), NOTHING_COUNTED)
        tier = credit_tier(window.card.latency_credit_tiers, ttft)
        if tier is None:
            lines.append(_report_line(model_id, window, ttft, commitment))
            continue
        objective = window.card.ttft_objective_ms
        attainment = round(ttft.within * 100 / ttft.counted, 3)
        percent = Decimal(str(tier["credit_percent"]))
        description = (
            f"Latency SLA credit: {attainment:.3f} % of {ttft.counted:,} guaranteed requests had "
            f"their first token within {objective:,} ms (below "
            f"{tier['below_attainment_percent']:g} %: {percent:g} % of the commitment)"
        )
        description += _not_counted(ttft)
        # quantity × unit_price is the amount: the percentage, times 1 % of the commitment.
        unit_price = -commitment / Decimal(100)
        lines.append(
            InvoiceLine(
                kind=InvoiceLine.Kind.CREDIT,
                served_model_id=model_id,
                rate_card=window.card,
                description=description[:300],
                starts_at=window.starts_at,
                ends_at=window.ends_at,
                quantity=percent,
                unit="% of commitment",
                unit_price=unit_price,
                amount=money(percent * unit_price),
                evidence={
                    "sla": "ttft",
                    "ttft_objective_ms": objective,
                    "attainment_percent": attainment,
                    "requests_counted": ttft.counted,
                    "requests_within_objective": ttft.within,
                    **_evidence(ttft),
                    "below_attainment_percent": tier["below_attainment_percent"],
                    "credit_percent": tier["credit_percent"],
                    "commitment": str(commitment),
                },
            )
        )
    return lines

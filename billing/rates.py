"""Rate cards: which version prices a model when, and versioning instead of editing. A card
holds the prices and the latency SLA (billing.latency: TTFT objective, attainment → credit)."""

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db import transaction
from django.db.models import Max

from billing.latency import latency_sla_clean
from billing.models import Invoice, InvoiceLine, RateCard
from billing.periods import period_bounds
from capacity.models import ServedModel
from core.audit import all_fields, audit_change, audit_record, snapshot
from core.errors import ConflictError, DomainError


@dataclass(frozen=True)
class RateSegment:
    starts_at: datetime
    ends_at: datetime
    card: RateCard


def rate_segments(cards: list[RateCard], start: datetime, end: datetime) -> list[RateSegment]:
    """The parts of [start, end) each card prices; `cards` are one model's, by effective_from.
    Time before the first card is unpriced and left out."""
    segments = []
    for index, card in enumerate(cards):
        card_end = cards[index + 1].effective_from if index + 1 < len(cards) else end
        lo, hi = max(start, card.effective_from), min(end, card_end)
        if lo < hi:
            segments.append(RateSegment(lo, hi, card))
    return segments


def cards_by_model(model_ids) -> dict[int, list[RateCard]]:
    """Each model's rate cards, by effective_from (the order rate_segments reads)."""
    cards: dict[int, list[RateCard]] = {}
    for card in RateCard.objects.filter(served_model_id__in=model_ids).order_by("effective_from"):
        cards.setdefault(card.served_model_id, []).append(card)
    return cards


def issued_through() -> datetime | None:
    """The end of the latest month with an issued invoice: no price may change before it."""
    latest = Invoice.objects.filter(status=Invoice.Status.ISSUED).aggregate(
        latest=Max("period_start")
    )["latest"]
    if latest is None:
        return None
    return period_bounds(latest)[2]


@transaction.atomic
def rate_card_create(
    *,
    served_model: ServedModel,
    effective_from: datetime,
    reserved_price_per_mu_minute_hour: Decimal,
    best_effort_price_per_1000_mu: Decimal,
    keep_warm_price_per_mu_minute_hour: Decimal = Decimal(0),
    currency: str = "USD",
    ttft_objective_ms: int | None = None,
    latency_credit_tiers: list | None = None,
) -> RateCard:
    """A new rate card for a model from `effective_from` (audited): a ConflictError
    for a second one at the same moment or one inside an issued period, a DomainError for a
    negative price or a bad latency SLA."""
    if RateCard.objects.filter(served_model=served_model, effective_from=effective_from).exists():
        raise ConflictError(
            "A rate card for this model already takes effect at that time.",
            field="effective_from",
        )
    frozen_until = issued_through()
    if frozen_until is not None and effective_from < frozen_until:
        # A card runs until the next one, so one dated inside (or before) an issued month
        # would reprice usage already invoiced, through late-usage adjustments.
        raise ConflictError(
            "Invoices are issued up to "
            f"{frozen_until:%Y-%m-%dT%H:%M:%SZ}; a rate card may not take effect inside an issued "
            "period. Date it at or after that moment.",
            field="effective_from",
            code="inside_issued_period",
            details={"issued_through": frozen_until.isoformat()},
        )
    for name, price in (
        ("reserved_price_per_mu_minute_hour", reserved_price_per_mu_minute_hour),
        ("best_effort_price_per_1000_mu", best_effort_price_per_1000_mu),
        ("keep_warm_price_per_mu_minute_hour", keep_warm_price_per_mu_minute_hour),
    ):
        if price < 0:
            raise DomainError("Prices cannot be negative.", field=name)
    tiers = latency_sla_clean(
        ttft_objective_ms=ttft_objective_ms, latency_credit_tiers=latency_credit_tiers
    )
    card = RateCard.objects.create(
        served_model=served_model,
        effective_from=effective_from,
        currency=currency.upper(),
        reserved_price_per_mu_minute_hour=reserved_price_per_mu_minute_hour,
        best_effort_price_per_1000_mu=best_effort_price_per_1000_mu,
        keep_warm_price_per_mu_minute_hour=keep_warm_price_per_mu_minute_hour,
        ttft_objective_ms=ttft_objective_ms,
        latency_credit_tiers=tiers,
    )
    audit_record(action="rate_card.create", obj=card, after=snapshot(card, all_fields(card)))
    return card


def rate_card_used(card: RateCard) -> bool:
    """Whether an issued invoice has priced with this card."""
    return InvoiceLine.objects.filter(rate_card=card, invoice__status="issued").exists()


@transaction.atomic
def rate_card_update(*, rate_card: RateCard, **prices) -> RateCard:
    """Change an unused card's prices (and latency SLA); a used one is refused (publish a new
    version)."""
    card = RateCard.objects.select_for_update().get(pk=rate_card.pk)
    if rate_card_used(card):
        raise ConflictError(
            "This rate card has priced an issued invoice and cannot change; create a new "
            "version that takes effect at a later date.",
            field="effective_from",
        )
    before = snapshot(card, all_fields(card))
    for name, value in prices.items():
        setattr(card, name, value)
    card.latency_credit_tiers = latency_sla_clean(
        ttft_objective_ms=card.ttft_objective_ms, latency_credit_tiers=card.latency_credit_tiers
    )
    card.save()
    audit_change(
        action="rate_card.update", obj=card, before=before, after=snapshot(card, all_fields(card))
    )
    return card

"""Monthly invoices from reservations (commitment, prorated to the minute, per rate card in
force), metered best-effort MU (per rate card in force) and SLA credits: for guaranteed
requests refused below the reservation (here), and for guaranteed requests' time to first
token against the card's objective (billing.latency).

Idempotent: a run replaces the period's draft invoices and never touches issued ones; issuing
freezes an invoice (`invoice_issue`). A run reads what it bills and replaces the drafts in one
transaction under the period's advisory lock: concurrent runs take turns, and the one that
writes last has read last, so an older run never overwrites a newer run's drafts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from accounts.models import Customer
from billing.commitments import commitment_segments, keep_warm_segments
from billing.latency import latency_counts, latency_credit_lines
from billing.models import Invoice, InvoiceLine
from billing.money import money
from billing.periods import period_bounds
from billing.rates import cards_by_model, rate_segments
from capacity.models import Reservation, ReservationChange, UsageMinute
from core.audit import audit_record
from core.db import Lock, lock_for_transaction
from core.errors import ConflictError


@dataclass
class GenerationResult:
    period: str
    drafts: int = 0
    skipped_issued: int = 0
    unpriced: list[str] = field(default_factory=list)  # what had no rate card


def _whole_minutes(start: datetime, end: datetime) -> int:
    return int((end - start).total_seconds() // 60)


def build_lines(period: str | date, *, customers=None, until: datetime | None = None):
    """(first day, {customer id: [unsaved InvoiceLine]}, result) for the period: what its
    invoices hold, computed in a fixed number of queries whatever the number of customers."""
    first, start, end = period_bounds(period)
    if until is not None:  # to date: nothing after `until` is billed
        end = max(start, min(end, until))
    result = GenerationResult(period=f"{first:%Y-%m}")
    reservations = defaultdict(list)
    for reservation in (
        Reservation.objects.filter(starts_at__lt=end)
        .exclude(ends_at__lte=start)
        .exclude(cancelled_at__lte=start)
    ):
        reservations[reservation.customer_id].append(reservation)
    changes = defaultdict(list)
    for change in ReservationChange.objects.filter(
        reservation_id__in=[r.pk for rs in reservations.values() for r in rs]
    ).order_by("changed_at"):
        changes[change.reservation_id].append(change)
    used = (
        UsageMinute.objects.filter(minute__gte=start, minute__lt=end)
        .values_list("customer_id", "served_model_id")
        .distinct()
    )
    late = _late_usage(first)
    customer_ids = set(reservations) | {c for c, _ in used} | set(late)
    if customers is not None:
        customer_ids &= {c.pk for c in customers}
    model_ids = {r.served_model_id for rs in reservations.values() for r in rs}
    model_ids |= {m for _, m in used}
    cards = cards_by_model(model_ids)
    segments = {m: rate_segments(cards.get(m, []), start, end) for m in model_ids}
    best_effort = _best_effort_mu(segments)
    credits = _credit_minutes(start, end)
    reserved_customers: dict[int, set[int]] = defaultdict(set)
    for customer_id in customer_ids:
        for reservation in reservations[customer_id]:
            reserved_customers[reservation.served_model_id].add(customer_id)
    ttft = latency_counts(segments, reserved_customers)
    lines_by_customer = {}
    for customer_id in sorted(customer_ids):
        own = reservations[customer_id]
        commitments = _commitment_lines(own, changes, segments, start, end, result)
        lines = list(commitments)
        lines += _keep_warm_lines(own, changes, segments, start, end)
        lines += _best_effort_lines(customer_id, best_effort, segments)
        lines += _credit_lines(customer_id, credits, own, changes, segments, start, end)
        lines += latency_credit_lines(customer_id, ttft, commitments)
        lines += late.get(customer_id, [])
        lines_by_customer[customer_id] = lines
    return first, lines_by_customer, result


def invoice_generate(*, period: str | date, customers=None) -> GenerationResult:
    """Build the period's invoices and replace their drafts, under the period's lock;
    issued invoices are left as they are (see the module docstring)."""
    first, _, _ = period_bounds(period)
    with transaction.atomic():
        # Lines are built after the lock is held (READ COMMITTED: each query sees what the
        # runs before this one committed), never before it.
        _lock_period(first)
        first, lines_by_customer, result = build_lines(period, customers=customers)
        _store_drafts(first, lines_by_customer, result)
    return result


def _lock_period(first: date) -> None:
    """The period's advisory lock, to the end of the transaction. SQLite needs none: its
    transactions begin IMMEDIATE (settings), which serialises writers anyway."""
    lock_for_transaction(Lock.INVOICE_PERIOD, first.year * 12 + first.month)


def invoice_estimate(*, customer: Customer, period: str | date) -> dict:
    """What the customer's invoice for the period holds so far (not stored): the live
    month-to-date estimate; commitments count up to now, not to the month's end."""
    first, lines_by_customer, _ = build_lines(period, customers=[customer], until=timezone.now())
    lines = lines_by_customer.get(customer.pk, [])
    subtotal, credits, total = lines_totals(lines)
    return {
        "customer": customer.slug,
        "period": f"{first:%Y-%m}",
        "subtotal": subtotal,
        "credits": credits,
        "total": total,
        "lines": lines,
    }


def lines_totals(lines: list[InvoiceLine]) -> tuple[Decimal, Decimal, Decimal]:
    """(subtotal, credits, total) of lines already rounded: sums, never rounded again; a
    credit larger than the charges leaves a total of zero, not a negative invoice."""
    amounts = [line.amount for line in lines]
    subtotal = sum((a for a in amounts if a > 0), Decimal(0))
    credits = -sum((a for a in amounts if a < 0), Decimal(0))
    return money(subtotal), money(credits), money(max(Decimal(0), subtotal - credits))


def _commitment_lines(reservations, changes, segments, start, end, result) -> list[InvoiceLine]:
    lines = []
    for reservation in reservations:
        model_segments = segments.get(reservation.served_model_id, [])
        for part in commitment_segments(reservation, changes[reservation.pk], start, end):
            priced = False
            for rate in model_segments:
                lo, hi = max(part.starts_at, rate.starts_at), min(part.ends_at, rate.ends_at)
                minutes = _whole_minutes(lo, hi) if lo < hi else 0
                if minutes <= 0:
                    continue
                priced = True
                # MU/min reserved for so many hours, prorated to the minute.
                quantity = Decimal(str(part.mu_per_minute)) * Decimal(minutes) / Decimal(60)
                price = rate.card.reserved_price_per_mu_minute_hour
                lines.append(
                    InvoiceLine(
                        kind=InvoiceLine.Kind.COMMITMENT,
                        served_model_id=reservation.served_model_id,
                        reservation=reservation,
                        rate_card=rate.card,
                        description=(
                            f"Reservation #{reservation.pk}: {part.mu_per_minute:g} MU/min, "
                            f"{minutes} min"
                        ),
                        starts_at=lo,
                        ends_at=hi,
                        quantity=quantity,
                        unit="MU/min·hour",
                        unit_price=price,
                        amount=money(quantity * price),
                        evidence={"mu_per_minute": part.mu_per_minute, "minutes": minutes},
                    )
                )
            if not priced:
                result.unpriced.append(
                    f"reservation #{reservation.pk}: no rate card for its model in the period"
                )
    return lines


def _keep_warm_lines(reservations, changes, segments, start, end) -> list[InvoiceLine]:
    """The keep-warm premium: for the minutes a reservation held keep-warm, its MU/min × hours
    × the card's keep-warm price, prorated and split like the commitment; none where the card
    charges nothing for it."""
    lines = []
    for reservation in reservations:
        model_segments = segments.get(reservation.served_model_id, [])
        for part in keep_warm_segments(reservation, changes[reservation.pk], start, end):
            for rate in model_segments:
                price = rate.card.keep_warm_price_per_mu_minute_hour
                lo, hi = max(part.starts_at, rate.starts_at), min(part.ends_at, rate.ends_at)
                minutes = _whole_minutes(lo, hi) if lo < hi else 0
                if minutes <= 0 or price <= 0:
                    continue
                quantity = Decimal(str(part.mu_per_minute)) * Decimal(minutes) / Decimal(60)
                lines.append(
                    InvoiceLine(
                        kind=InvoiceLine.Kind.KEEP_WARM,
                        served_model_id=reservation.served_model_id,
                        reservation=reservation,
                        rate_card=rate.card,
                        description=(
                            f"Keep-warm premium, reservation #{reservation.pk}: "
                            f"{part.mu_per_minute:g} MU/min kept warm, {minutes} min"
                        ),
                        starts_at=lo,
                        ends_at=hi,
                        quantity=quantity,
                        unit="MU/min·hour",
                        unit_price=price,
                        amount=money(quantity * price),
                        evidence={"mu_per_minute": part.mu_per_minute, "minutes": minutes},
                    )
                )
    return lines


@dataclass(frozen=True)
class _BestEffortUse:
    mu: float  # MU used outside guaranteed admission: what is billed
    self_reported_mu: float  # of all MU, what the customer's own keys reported
    unverified_mu: float  # of all MU, what no admission record confirmed


def _best_effort_mu(segments) -> dict[int, dict[tuple[int, int], _BestEffortUse]]:
    """customer -> (model, rate card) -> MU used outside guaranteed admission."""
    totals: dict[int, dict[tuple[int, int], _BestEffortUse]] = defaultdict(dict)
    for model_id, model_segments in segments.items():
        for rate in model_segments:
            rows = (
                UsageMinute.objects.filter(
                    served_model_id=model_id, minute__gte=rate.starts_at, minute__lt=rate.ends_at
                )
                .values("customer_id")
                .annotate(
                    mu=Sum(F("mu") - F("guaranteed_mu")),
                    self_reported=Sum("self_reported_mu"),
                    unverified=Sum("unverified_mu"),
                )
            )
            for row in rows:
                if row["mu"] and row["mu"] > 0:
                    totals[row["customer_id"]][(model_id, rate.card.pk)] = _BestEffortUse(
                        row["mu"], row["self_reported"] or 0.0, row["unverified"] or 0.0
                    )
    return totals


def _late_usage(first: date) -> dict[int, list[InvoiceLine]]:
    """Adjustment lines for best-effort usage that arrived after the previous month's invoice
    was issued: what the rollups hold for that month now, less what the issued invoice billed,
    per model and rate card. Usage later than USAGE_LATENESS_WINDOW_HOURS (72 h) is refused at
    ingestion, so the previous month is the only one that can still change."""
    previous, start, end = period_bounds(first - timedelta(days=1))
    issued = {
        invoice.customer_id: invoice
        for invoice in Invoice.objects.filter(
            period_start=previous, status=Invoice.Status.ISSUED
        ).prefetch_related("lines")
    }
    if not issued:
        return {}
    model_ids = set(
        UsageMinute.objects.filter(
            minute__gte=start, minute__lt=end, customer_id__in=list(issued)
        ).values_list("served_model_id", flat=True)
    )
    cards = cards_by_model(model_ids)
    segments = {m: rate_segments(cards.get(m, []), start, end) for m in model_ids}
    by_card = {r.card.pk: r.card for s in segments.values() for r in s}
    now_mu = _best_effort_mu(segments)
    adjustments: dict[int, list[InvoiceLine]] = defaultdict(list)
    for customer_id, invoice in issued.items():
        billed: dict[tuple[int, int], float] = defaultdict(float)
        for line in invoice.lines.all():
            if line.kind == InvoiceLine.Kind.BEST_EFFORT:
                billed[(line.served_model_id, line.rate_card_id)] += line.evidence.get("mu", 0.0)
        current = {key: use.mu for key, use in now_mu.get(customer_id, {}).items()}
        for model_id, card_id in sorted(set(current) | set(billed)):
            delta = current.get((model_id, card_id), 0.0) - billed[(model_id, card_id)]
            if abs(delta) < 1e-6 or card_id not in by_card:
                continue
            card = by_card[card_id]
            quantity = Decimal(str(delta)) / Decimal(1000)
            adjustments[customer_id].append(
                InvoiceLine(
                    kind=InvoiceLine.Kind.ADJUSTMENT,
                    served_model_id=model_id,
                    rate_card=card,
                    description=f"Late best-effort usage for {previous:%Y-%m}: {delta:,.3f} MU",
                    quantity=quantity,
                    unit="1,000 MU",
                    unit_price=card.best_effort_price_per_1000_mu,
                    amount=money(quantity * card.best_effort_price_per_1000_mu),
                    evidence={"period": f"{previous:%Y-%m}", "mu": delta, "invoice": invoice.pk},
                )
            )
    return adjustments


def _best_effort_lines(customer_id, best_effort, segments) -> list[InvoiceLine]:
    cards = {r.card.pk: r for s in segments.values() for r in s}
    lines = []
    for (model_id, card_id), use in sorted(best_effort.get(customer_id, {}).items()):
        rate = cards[card_id]
        mu = use.mu
        quantity = Decimal(str(mu)) / Decimal(1000)
        price = rate.card.best_effort_price_per_1000_mu
        description = f"Best-effort usage: {mu:,.3f} MU"
        # The usage behind the charge that the platform did not meter itself is named on the
        # line, so the customer and finance can see what rests on the customer's own reports.
        notes = []
        if use.self_reported_mu > 0:
            notes.append(f"{use.self_reported_mu:,.3f} MU self-reported")
        if use.unverified_mu > 0:
            notes.append(f"{use.unverified_mu:,.3f} MU without an admission record")
        if notes:
            description += f" ({'; '.join(notes)})"
        lines.append(
            InvoiceLine(
                kind=InvoiceLine.Kind.BEST_EFFORT,
                served_model_id=model_id,
                rate_card=rate.card,
                description=description,
                starts_at=rate.starts_at,
                ends_at=rate.ends_at,
                quantity=quantity,
                unit="1,000 MU",
                unit_price=price,
                amount=money(quantity * price),
                evidence={
                    "mu": mu,
                    "self_reported_mu": use.self_reported_mu,
                    "unverified_mu": use.unverified_mu,
                },
            )
        )
    return lines


def _credit_minutes(start, end) -> dict[int, list]:
    minutes = defaultdict(list)
    # Only customers with a reservation can earn a credit.
    reserved = Reservation.objects.filter(starts_at__lt=end).values("customer_id")
    for row in UsageMinute.objects.filter(
        minute__gte=start,
        minute__lt=end,
        guaranteed_refused_requests__gt=0,
        customer_id__in=reserved,
    ).values(
        "customer_id", "served_model_id", "minute", "guaranteed_mu", "guaranteed_refused_requests"
    ):
        minutes[row["customer_id"]].append(row)
    return minutes


def _credit_lines(
    customer_id, credits, reservations, changes, segments, start, end
) -> list[InvoiceLine]:
    """A credit for every minute a guaranteed request was refused while the customer used
    less than its reservation: `BILLING_SLA_CREDIT_SHARE` of that minute's commitment."""
    rows = credits.get(customer_id, [])
    if not rows or not reservations:
        return []
    share = Decimal(str(settings.BILLING_SLA_CREDIT_SHARE))
    # Each reservation's commitment over the period, once, rather than once per minute.
    committed: dict[int, list] = defaultdict(list)
    for r in reservations:
        committed[r.served_model_id] += commitment_segments(r, changes[r.pk], start, end)
    by_model: dict[int, list] = defaultdict(list)
    for row in rows:
        minute = row["minute"]
        reserved = sum(
            part.mu_per_minute
            for part in committed.get(row["served_model_id"], ())
            if part.starts_at <= minute < part.ends_at
        )
        if reserved <= 0 or row["guaranteed_mu"] >= reserved:
            continue
        rate = next(
            (
                s
                for s in segments.get(row["served_model_id"], [])
                if s.starts_at <= minute < s.ends_at
            ),
            None,
        )
        if rate is None:
            continue
        by_model[row["served_model_id"]].append((row, reserved, rate.card))
    lines = []
    for model_id, rows in sorted(by_model.items()):
        value = sum(
            Decimal(str(reserved)) * card.reserved_price_per_mu_minute_hour / Decimal(60) * share
            for _, reserved, card in rows
        )
        lines.append(
            InvoiceLine(
                kind=InvoiceLine.Kind.CREDIT,
                served_model_id=model_id,
                # The card of its first minute: the credit is in that card's currency.
                rate_card=rows[0][2],
                description=f"SLA credit: {len(rows)} minute(s) with guaranteed requests refused "
                "below the reservation",
                quantity=Decimal(len(rows)),
                unit="minute",
                unit_price=Decimal(0),
                amount=-money(value),
                evidence={
                    "share": str(share),
                    "minutes": [
                        {
                            "minute": row["minute"].isoformat(),
                            "reserved_mu_per_minute": reserved,
                            "guaranteed_mu_used": row["guaranteed_mu"],
                            "guaranteed_refused": row["guaranteed_refused_requests"],
                        }
                        for row, reserved, _ in rows
                    ],
                },
            )
        )
    return lines


def _store_drafts(first: date, lines_by_customer: dict, result: GenerationResult) -> None:
    """Replace the period's drafts of these customers, inside invoice_generate's transaction
    and lock; customers with an issued invoice for the period are left exactly as they are."""
    now = timezone.now()
    with transaction.atomic():
        issued = set(
            Invoice.objects.filter(
                period_start=first,
                status=Invoice.Status.ISSUED,
                customer_id__in=list(lines_by_customer),
            ).values_list("customer_id", flat=True)
        )
        result.skipped_issued = len(issued)
        customer_ids = [c for c in lines_by_customer if c not in issued]
        drafts = Invoice.objects.filter(
            period_start=first, status=Invoice.Status.DRAFT, customer_id__in=customer_ids
        )
        InvoiceLine.objects.filter(invoice__in=drafts).delete()
        drafts.delete()
        invoices, lines = [], []
        for customer_id in customer_ids:
            by_currency: dict[str, list[InvoiceLine]] = defaultdict(list)
            for line in lines_by_customer[customer_id]:
                currency = line.rate_card.currency if line.rate_card else settings.BILLING_CURRENCY
                by_currency[currency].append(line)
            for currency, currency_lines in sorted(by_currency.items()):
                subtotal, credits, total = lines_totals(currency_lines)
                invoice = Invoice(
                    customer_id=customer_id,
                    period_start=first,
                    currency=currency,
                    subtotal=subtotal,
                    credits=credits,
                    total=total,
                    generated_at=now,
                )
                invoices.append((invoice, currency_lines))
        Invoice.objects.bulk_create([invoice for invoice, _ in invoices], batch_size=2000)
        for invoice, currency_lines in invoices:
            for line in currency_lines:
                line.invoice = invoice
                lines.append(line)
        InvoiceLine.objects.bulk_create(lines, batch_size=5000)
        result.drafts = len(invoices)


@transaction.atomic
def invoice_issue(*, invoice: Invoice, actor: str | None = None) -> Invoice:
    """Freeze a draft invoice (audited); a ConflictError for one not a draft."""
    invoice = Invoice.objects.select_for_update().get(pk=invoice.pk)
    if invoice.status != Invoice.Status.DRAFT:
        raise ConflictError(f"Only a draft can be issued; this invoice is {invoice.status}.")
    invoice.status = Invoice.Status.ISSUED
    invoice.issued_at = timezone.now()
    invoice.save(update_fields=["status", "issued_at"])
    audit_record(
        actor=actor,
        action="invoice.issue",
        obj=invoice,
        before={"status": Invoice.Status.DRAFT},
        after={"status": invoice.status, "total": str(invoice.total)},
    )
    return invoice

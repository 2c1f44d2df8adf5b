"""Budgets and spend alerts (issue 23 part 2).

A budget is a customer's (over all its keys) or one key's (the requests sent with it).

- **Spend** is month-to-date. A customer's: what its invoice for this month holds so far, from
  the invoice's own lines (`billing.generation.build_lines(..., until=now)`), counting the
  lines in the budget's currency: there is no second pricing path. A key's: what the requests
  sent with that key were billed beyond the reservations, i.e. their best-effort MU (the key
  rollups, `capacity.UsageKeyMinute`, from the key each usage event's admission record
  names) priced per model and rate card in force exactly as the invoice's best-effort lines
  price them. The commitment is the customer's, not a key's: it counts in the customer's
  budget only.
- **Alerts** at 50, 80 and 100 % of a budget, and when a reservation in term for the whole
  last week used under 20 % of it over that week (the sale is at risk). Each goes by email
  (Django's mail: the SMTP server is an operator setting; to the budget's `alert_email`, else
  the customer's owners) and by the signed alert webhook of capacity alerts
  (ALERT_WEBHOOK_URL, `capacity.telemetry.alerts.send_alert`). An alert is a `BudgetAlert` row
  per channel, inserted before it is sent and sent after the commit: the unique constraints
  decide that it goes at most once per threshold (budget) or reservation (under-use) and month,
  however many checks run at once. A delivery that fails is recorded on its row, not retried.
- **Hard cap**: past 100 % of a budget with `hard_cap`, admission refuses the best-effort
  requests of the customer (`limit: "budget"`, `limit_scope: "customer"`) or of the key
  (`limit_scope: "api_key"`; the customer's other keys are admitted as before); capacity owns
  the flag (`capacity.admission.limits.budget_cap_set`), billing decides when. A new month, a
  larger budget or the cap turned off lifts it at the next check (or at once, for a change
  made through the services).

`budgets_check` runs every BUDGET_CHECK_MINUTES (billing.schedules, Celery
`billing.check_budgets`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.utils import timezone

from accounts.models import ApiKey, Customer, Membership
from billing.generation import build_lines, lines_totals
from billing.models import Budget, BudgetAlert
from billing.money import money
from billing.periods import period_bounds
from billing.rates import cards_by_model, rate_segments
from capacity.admission.limits import budget_cap_of, budget_cap_set, budget_caps_of_customers
from capacity.metering.utilisation import customer_utilisation
from capacity.models import Reservation, UsageKeyMinute
from capacity.telemetry.alerts import send_alert
from core.audit import all_fields, audit_change, audit_record, current_actor, snapshot
from core.errors import ConflictError, DomainError

logger = logging.getLogger(__name__)

THRESHOLDS_PERCENT = (50, 80, 100)
UNDERUSE_PERCENT = 20
UNDERUSE_WINDOW = timedelta(days=7)
BUDGET_FIELDS = ("monthly_amount", "currency", "hard_cap", "alert_email")
SYSTEM_ACTOR = "system:budget-check"


@dataclass(frozen=True)
class BudgetStatus:
    budget: Budget
    period: str  # YYYY-MM
    spend: Decimal  # month to date, in the budget's currency
    percent: float  # of the monthly amount
    capped: bool  # admission refuses the customer's best-effort now


# --- Writes -----------------------------------------------------------------------------------


def _check(values: dict) -> None:
    amount = values.get("monthly_amount")
    if amount is not None and amount <= 0:
        raise DomainError("monthly_amount must be more than 0.", field="monthly_amount")
    currency = values.get("currency")
    if currency is not None and not (len(currency) == 3 and currency.isalpha()):
        raise DomainError("currency is a three-letter code, e.g. USD.", field="currency")


@transaction.atomic
def budget_create(
    *,
    customer: Customer,
    monthly_amount: Decimal,
    api_key: ApiKey | None = None,
    currency: str | None = None,
    hard_cap: bool = False,
    alert_email: str = "",
    actor: str | None = None,
) -> Budget:
    """The customer's budget, or with `api_key` one of its keys' (one of each at most)."""
    values = {"monthly_amount": monthly_amount, "currency": currency}
    _check(values)
    if api_key is not None and api_key.customer_id != customer.pk:
        raise DomainError(
            f"The key {api_key.prefix} is not one of {customer.slug}'s keys.", field="api_key"
        )
    Customer.objects.select_for_update().filter(pk=customer.pk).first()
    existing = Budget.objects.filter(customer=customer, api_key=api_key).first()
    if existing is not None:
        whose = f"The key {api_key.prefix}" if api_key is not None else customer.slug
        raise ConflictError(
            f"{whose} has a budget already (#{existing.pk}): change it with PATCH.",
            field="api_key" if api_key is not None else "customer",
            code="exists",
        )
    actor = actor or current_actor()
    budget = Budget.objects.create(
        customer=customer,
        api_key=api_key,
        monthly_amount=monthly_amount,
        currency=(currency or settings.BILLING_CURRENCY).upper(),
        hard_cap=hard_cap,
        alert_email=alert_email,
        updated_by=actor[:200],
    )
    audit_record(actor=actor, action="budget.create", obj=budget, after=_state(budget))
    _enforce_cap(budget, budget_status(budget), actor=actor)
    return budget


@transaction.atomic
def budget_update(*, budget: Budget, changes: dict, actor: str | None = None) -> Budget:
    """Change a budget's amount, currency, hard cap or alert address (audited); the cap
    follows the change at once. Any other field is refused, naming it."""
    unknown = sorted(set(changes) - set(BUDGET_FIELDS))
    if unknown:
        raise DomainError(f"{unknown[0]} cannot be changed.", field=unknown[0])
    _check(changes)
    budget = Budget.objects.select_for_update().get(pk=budget.pk)
    before = _state(budget)
    for name, value in changes.items():
        setattr(budget, name, value.upper() if name == "currency" else value)
    actor = actor or current_actor()
    budget.updated_by = actor[:200]
    budget.save()
    audit_change(
        actor=actor, action="budget.update", obj=budget, before=before, after=_state(budget)
    )
    # A larger budget, or the cap turned off, lifts the cap now, not at the next check.
    _enforce_cap(budget, budget_status(budget), actor=actor)
    return budget


@transaction.atomic
def budget_delete(*, budget: Budget, actor: str | None = None) -> None:
    """Delete a budget (audited) and lift the hard cap it held."""
    actor = actor or current_actor()
    before = _state(budget)
    pk, label, customer, api_key = budget.pk, str(budget), budget.customer, budget.api_key
    budget.delete()
    audit_record(
        actor=actor,
        action="budget.delete",
        object_type=Budget._meta.label_lower,
        object_id=pk,
        object_repr=label,
        before=before,
    )
    budget_cap_set(customer=customer, api_key=api_key, capped=False, actor=actor)


def _state(budget: Budget) -> dict:
    fields = [f for f in all_fields(budget) if f not in ("updated_by", "api_key")]
    return {
        **snapshot(budget, fields),
        "api_key": budget.api_key.prefix if budget.api_key_id else None,
    }


# --- Reads ------------------------------------------------------------------------------------


def _spend_by_customer(customer_ids: list[int], *, now: datetime) -> dict[int, dict[str, Decimal]]:
    """customer -> currency -> month-to-date total of its invoice's lines (one build_lines for
    every customer asked)."""
    if not customer_ids:
        return {}
    customers = list(Customer.objects.filter(pk__in=customer_ids))
    _, lines_by_customer, _ = build_lines(f"{now:%Y-%m}", customers=customers, until=now)
    spend: dict[int, dict[str, Decimal]] = {}
    for customer_id, lines in lines_by_customer.items():
        by_currency: dict[str, list] = {}
        for line in lines:
            currency = line.rate_card.currency if line.rate_card else settings.BILLING_CURRENCY
            by_currency.setdefault(currency.upper(), []).append(line)
        spend[customer_id] = {c: lines_totals(ls)[2] for c, ls in by_currency.items()}
    return spend


def _spend_by_key(keys: list[tuple[int, str]], *, now: datetime) -> dict[str, dict[str, Decimal]]:
    """key prefix -> currency -> month-to-date best-effort charge of the requests sent with the
    key (`keys`: (customer id, prefix)). Priced as the invoice prices best-effort usage
    (billing.generation's best-effort lines): per model and rate card in force, MU used outside
    the guarantee / 1,000 × the card's best-effort price, each (model, card) rounded to cents
    like a line, then summed. A fixed number of queries per model and card, whatever the
    number of keys."""
    if not keys:
        return {}
    _, start, end = period_bounds(f"{now:%Y-%m}")
    end = max(start, min(end, now))
    rows = UsageKeyMinute.objects.filter(
        customer_id__in={c for c, _ in keys},
        api_key_prefix__in={p for _, p in keys},
        minute__gte=start,
        minute__lt=end,
    )
    model_ids = set(rows.values_list("served_model_id", flat=True).distinct())
    cards = cards_by_model(model_ids)
    spend: dict[str, dict[str, Decimal]] = {}
    for model_id in sorted(model_ids):
        for rate in rate_segments(cards.get(model_id, []), start, end):
            used = (
                rows.filter(
                    served_model_id=model_id, minute__gte=rate.starts_at, minute__lt=rate.ends_at
                )
                .values("api_key_prefix")
                .annotate(mu=Sum(F("mu") - F("guaranteed_mu")))
                .order_by()
            )
            for row in used:
                mu = row["mu"] or 0.0
                if mu <= 0:
                    continue
                amount = money(
                    Decimal(str(mu)) / Decimal(1000) * rate.card.best_effort_price_per_1000_mu
                )
                by_currency = spend.setdefault(row["api_key_prefix"], {})
                currency = rate.card.currency.upper()
                by_currency[currency] = by_currency.get(currency, Decimal(0)) + amount
    return spend


def _spend_of(budgets: list[Budget], *, now: datetime) -> dict[int, dict[str, Decimal]]:
    """budget -> currency -> month-to-date spend (a customer's or a key's)."""
    by_customer = _spend_by_customer(
        sorted({b.customer_id for b in budgets if b.api_key_id is None}), now=now
    )
    by_key = _spend_by_key(
        sorted({(b.customer_id, b.api_key.prefix) for b in budgets if b.api_key_id}), now=now
    )
    return {
        budget.pk: (
            by_key.get(budget.api_key.prefix, {})
            if budget.api_key_id
            else by_customer.get(budget.customer_id, {})
        )
        for budget in budgets
    }


def _status(budget: Budget, spend: dict[str, Decimal], now: datetime, capped: bool):
    amount = money(spend.get(budget.currency.upper(), Decimal(0)))
    percent = float(amount / budget.monthly_amount * 100) if budget.monthly_amount else 0.0
    return BudgetStatus(budget, f"{now:%Y-%m}", amount, percent, capped)


def budget_status(budget: Budget, *, now: datetime | None = None) -> BudgetStatus:
    """The budget's month-to-date spend, its share of the budget and whether its cap
    holds now."""
    now = now or timezone.now()
    spend = _spend_of([budget], now=now)[budget.pk]
    capped = budget_cap_of(budget.customer, budget.api_key) is not None
    return _status(budget, spend, now, capped)


def budget_statuses(budgets: list[Budget], *, now: datetime | None = None) -> list[BudgetStatus]:
    """The status of each budget, spend computed once for them all."""
    now = now or timezone.now()
    spend = _spend_of(budgets, now=now)
    caps = budget_caps_of_customers({b.customer_id for b in budgets})
    return [_status(b, spend[b.pk], now, (b.customer_id, b.api_key_id) in caps) for b in budgets]


def budget_of_customer(customer: Customer) -> Budget | None:
    """The customer's own budget (over all its keys)."""
    return Budget.objects.filter(customer=customer, api_key__isnull=True).first()


def budgets_of_customer(customer: Customer) -> list[Budget]:
    """The customer's budget first, then its keys' by prefix."""
    return sorted(
        Budget.objects.filter(customer=customer).select_related("api_key"),
        key=lambda b: (b.api_key_id is not None, b.api_key.prefix if b.api_key_id else ""),
    )


def alerts_of_budget(budget: Budget, *, limit: int = 20) -> list[BudgetAlert]:
    """The budget's latest alerts (at most `limit`), newest first."""
    return list(BudgetAlert.objects.filter(budget=budget).order_by("-created_at", "pk")[:limit])


# --- The periodic check -----------------------------------------------------------------------


def budgets_check(*, now: datetime | None = None) -> dict:
    """Every budget against its month-to-date spend (alerts, hard cap), then every reservation's
    last week (under-use alerts). Alerts are sent after the commit of the rows that claim them."""
    now = now or timezone.now()
    budgets = list(Budget.objects.select_related("customer", "api_key").order_by("pk"))
    spend = _spend_of(budgets, now=now)
    claimed = 0
    for budget in budgets:
        with transaction.atomic():
            status = _status(budget, spend[budget.pk], now, False)
            claimed += _budget_alerts(status, now)
            _enforce_cap(budget, status, actor=SYSTEM_ACTOR)
    claimed += reservations_underuse_check(now=now)
    return {"budgets": len(budgets), "alerts": claimed}


def _enforce_cap(budget: Budget, status: BudgetStatus, *, actor: str) -> None:
    over = budget.hard_cap and status.percent >= 100
    whose = f"key {budget.api_key.prefix}'s " if budget.api_key_id else ""
    reason = (
        f"{whose}monthly budget of {budget.monthly_amount} {budget.currency} spent "
        f"({status.spend} {budget.currency} in {status.period}): hard cap"
    )
    budget_cap_set(
        customer=budget.customer, api_key=budget.api_key, capped=over, reason=reason, actor=actor
    )


def _budget_alerts(status: BudgetStatus, now: datetime) -> int:
    budget = status.budget
    crossed = [t for t in THRESHOLDS_PERCENT if status.percent >= t]
    if not crossed:
        return 0
    detail = {
        "customer": budget.customer.slug,
        # The key whose budget it is (None: the customer's own, over all its keys).
        "api_key": budget.api_key.prefix if budget.api_key_id else None,
        "period": status.period,
        "spend": str(status.spend),
        "monthly_amount": str(budget.monthly_amount),
        "currency": budget.currency,
        "percent": round(status.percent, 2),
        "hard_cap": budget.hard_cap,
    }
    claimed = 0
    for threshold in crossed:
        claimed += _claim(
            kind=BudgetAlert.Kind.BUDGET,
            customer=budget.customer,
            budget=budget,
            period=status.period,
            threshold=threshold,
            detail={**detail, "threshold_percent": threshold},
            alert_email=budget.alert_email,
        )
    return claimed


def reservations_underuse_check(*, now: datetime | None = None) -> int:
    """A reservation in term for the whole last week whose customer used under 20 % of what it
    reserved of that model over the week (capacity.metering.utilisation): one alert per
    reservation and month."""
    now = (now or timezone.now()).replace(second=0, microsecond=0)
    start = now - UNDERUSE_WINDOW
    reservations = (
        Reservation.objects.filter(status=Reservation.Status.ACTIVE, starts_at__lte=start)
        .exclude(ends_at__lt=now)
        .select_related("customer", "served_model")
        .order_by("pk")
    )
    budgets = {b.customer_id: b for b in Budget.objects.filter(api_key__isnull=True)}
    utilisation: dict[tuple[int, int], float | None] = {}
    claimed = 0
    for reservation in reservations:
        pair = (reservation.customer_id, reservation.served_model_id)
        if pair not in utilisation:
            (week,) = customer_utilisation(
                customer=reservation.customer,
                served_model=reservation.served_model,
                start=start,
                end=now,
                step=UNDERUSE_WINDOW,
            )
            reserved = week["reserved_mu_per_minute"]
            utilisation[pair] = (
                week["used_mu_per_minute_mean"] / reserved * 100 if reserved > 0 else None
            )
        percent = utilisation[pair]
        if percent is None or percent >= UNDERUSE_PERCENT:
            continue
        budget = budgets.get(reservation.customer_id)
        with transaction.atomic():
            claimed += _claim(
                kind=BudgetAlert.Kind.UNDERUSE,
                customer=reservation.customer,
                reservation=reservation,
                period=f"{now:%Y-%m}",
                threshold=UNDERUSE_PERCENT,
                detail={
                    "customer": reservation.customer.slug,
                    "reservation": reservation.pk,
                    "model": reservation.served_model.name,
                    "mu_per_minute": reservation.mu_per_minute,
                    "utilisation_percent": round(percent, 2),
                    "window_start": start.isoformat(),
                    "window_end": now.isoformat(),
                },
                alert_email=budget.alert_email if budget else "",
            )
    return claimed


def _recipients(customer: Customer, alert_email: str) -> list[str]:
    if alert_email:
        return [alert_email]
    return sorted(
        set(
            Membership.objects.filter(customer=customer, role=Membership.Role.OWNER)
            .exclude(user__email="")
            .values_list("user__email", flat=True)
        )
    )


def _claim(
    *,
    kind: str,
    customer: Customer,
    period: str,
    threshold: int,
    detail: dict,
    alert_email: str,
    budget: Budget | None = None,
    reservation: Reservation | None = None,
) -> int:
    """Insert the alert's rows, one per channel in use; a row that conflicts was claimed by an
    earlier (or concurrent) check and is not sent again. Those inserted are sent after the
    commit of the caller's transaction."""
    channels: list[tuple[str, list[str]]] = []
    recipients = _recipients(customer, alert_email)
    if recipients:
        channels.append((BudgetAlert.Channel.EMAIL, recipients))
    if settings.ALERT_WEBHOOK_URL:
        channels.append((BudgetAlert.Channel.WEBHOOK, []))
    claimed = []
    for channel, to in channels:
        try:
            with transaction.atomic():  # a savepoint: a conflict leaves the rest standing
                claimed.append(
                    BudgetAlert.objects.create(
                        kind=kind,
                        customer=customer,
                        budget=budget,
                        reservation=reservation,
                        period=period,
                        threshold_percent=threshold,
                        channel=channel,
                        recipients=", ".join(to)[:1000],
                        detail=detail,
                    ).pk
                )
        except IntegrityError:
            continue  # sent already, or being sent by a concurrent check
    if claimed:
        transaction.on_commit(lambda: alerts_deliver(claimed))
    return len(claimed)


def alerts_deliver(alert_ids: list[int]) -> None:
    """Send claimed alerts and record how each went (sent_at, or the error)."""
    for alert in BudgetAlert.objects.filter(pk__in=alert_ids, sent_at__isnull=True):
        error = ""
        try:
            if alert.channel == BudgetAlert.Channel.EMAIL:
                subject, body = _message(alert)
                send_mail(
                    subject,
                    body,
                    settings.DEFAULT_FROM_EMAIL,
                    [r.strip() for r in alert.recipients.split(",") if r.strip()],
                )
            else:
                payload = {
                    "kind": f"billing_{alert.kind}",
                    "alert_id": alert.pk,
                    "threshold_percent": alert.threshold_percent,
                    **alert.detail,
                }
                if not send_alert(payload):
                    error = "the alert webhook did not accept it (see the log)"
        except Exception as failure:  # noqa: BLE001 - SMTP and sockets fail in many ways
            error = f"{type(failure).__name__}: {failure}"
        if error:
            logger.error("alert #%s by %s not delivered: %s", alert.pk, alert.channel, error)
            BudgetAlert.objects.filter(pk=alert.pk).update(error=error[:500])
        else:
            BudgetAlert.objects.filter(pk=alert.pk).update(sent_at=timezone.now())


def _message(alert: BudgetAlert) -> tuple[str, str]:
    d = alert.detail
    if alert.kind == BudgetAlert.Kind.BUDGET:
        key = d.get("api_key")
        if key:
            subject = (
                f"[{d['customer']}] key {key}: {alert.threshold_percent} % of its monthly "
                f"budget spent ({d['period']})"
            )
            body = (
                f"The requests {d['customer']} sent with the API key {key} have spent "
                f"{d['spend']} {d['currency']} beyond the reservations of the key's monthly "
                f"budget of {d['monthly_amount']} {d['currency']} in {d['period']} "
                f"({d['percent']} %).\n"
            )
        else:
            subject = (
                f"[{d['customer']}] {alert.threshold_percent} % of the monthly budget spent "
                f"({d['period']})"
            )
            body = (
                f"{d['customer']} has spent {d['spend']} {d['currency']} of its monthly budget "
                f"of {d['monthly_amount']} {d['currency']} in {d['period']} ({d['percent']} %).\n"
            )
        if d.get("hard_cap") and alert.threshold_percent >= 100:
            whose = f"sent with the key {key} " if key else ""
            body += (
                f"The budget's hard cap is on: requests {whose}beyond the reservations "
                "(best-effort) are refused until the month ends or the budget is raised.\n"
            )
        return subject, body
    subject = (
        f"[{d['customer']}] reservation #{d['reservation']} used {d['utilisation_percent']} % "
        "over the last week"
    )
    body = (
        f"Reservation #{d['reservation']} of {d['customer']} ({d['mu_per_minute']} MU/min of "
        f"{d['model']}) used {d['utilisation_percent']} % of what it reserves from "
        f"{d['window_start']} to {d['window_end']}: under {alert.threshold_percent} %.\n"
    )
    return subject, body

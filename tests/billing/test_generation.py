"""Monthly invoices against hand-computed amounts (November 2026: 30 days)."""

from datetime import UTC, datetime
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from billing.generation import invoice_generate, invoice_issue
from billing.models import Invoice, InvoiceLine
from billing.rates import rate_card_create, rate_card_update
from capacity.models import Reservation, ReservationChange, UsageMinute
from core.errors import ConflictError

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def at(day, hour=0, minute=0):
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)


@pytest.fixture
def card(served_model):
    # $0.10 per MU/min reserved for an hour; $2.00 per 1,000 best-effort MU.
    return rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )


def reserve(customer, model, mu_per_minute, starts_at, ends_at=None):
    return Reservation.objects.create(
        customer=customer,
        served_model=model,
        mu_per_minute=mu_per_minute,
        starts_at=starts_at,
        ends_at=ends_at,
        status="active",
    )


def used(customer, model, minute, mu, guaranteed_mu=0.0, refused=0):
    UsageMinute.objects.create(
        customer=customer,
        served_model=model,
        minute=minute,
        requests=10,
        mu=mu,
        guaranteed_mu=guaranteed_mu,
        best_effort_mu=mu - guaranteed_mu,
        guaranteed_refused_requests=refused,
    )


def invoice_of(customer):
    return Invoice.objects.get(customer=customer, period_start="2026-11-01")


def test_a_reservation_starting_mid_month_is_billed_from_its_start(card, served_model, acme):
    # 100 MU/min from 16 November: 15 days = 360 hours; 100 × 360 × $0.10 = $3,600.00.
    reserve(acme, served_model, 100, at(16))
    invoice_generate(period="2026-11")
    invoice = invoice_of(acme)
    assert invoice.status == "draft"
    assert invoice.total == Decimal("3600.00")
    (line,) = invoice.lines.all()
    assert (line.kind, line.quantity, line.amount) == (
        "commitment",
        Decimal("36000"),
        Decimal("3600.00"),
    )


def test_a_rate_change_mid_month_splits_the_commitment(card, served_model, acme):
    # From 21 November the price is $0.12: 16-21 Nov (120 h) at $0.10 = $1,200.00, then
    # 21 Nov-1 Dec (240 h) at $0.12 = $2,880.00; total $4,080.00.
    rate_card_create(
        served_model=served_model,
        effective_from=at(21),
        reserved_price_per_mu_minute_hour=Decimal("0.12"),
        best_effort_price_per_1000_mu=Decimal("2.50"),
    )
    reserve(acme, served_model, 100, at(16))
    invoice_generate(period="2026-11")
    amounts = sorted(line.amount for line in invoice_of(acme).lines.all())
    assert amounts == [Decimal("1200.00"), Decimal("2880.00")]
    assert invoice_of(acme).total == Decimal("4080.00")


def test_best_effort_usage_is_billed_per_1000_mu_at_the_card_in_force(card, served_model, globex):
    rate_card_create(
        served_model=served_model,
        effective_from=at(21),
        reserved_price_per_mu_minute_hour=Decimal("0.12"),
        best_effort_price_per_1000_mu=Decimal("2.50"),
    )
    used(globex, served_model, at(10, 12), 1500.0)  # 1.5 × $2.00 = $3.00
    used(globex, served_model, at(11, 12), 500.0, guaranteed_mu=500.0)  # guaranteed: not here
    used(globex, served_model, at(25, 8), 1000.0)  # 1 × $2.50 = $2.50
    invoice_generate(period="2026-11")
    lines = invoice_of(globex).lines.order_by("amount")
    assert [(line.kind, line.amount) for line in lines] == [
        ("best_effort", Decimal("2.50")),
        ("best_effort", Decimal("3.00")),
    ]
    assert invoice_of(globex).total == Decimal("5.50")


def test_a_guaranteed_refusal_below_the_reservation_earns_a_credit(
    card, served_model, acme, settings
):
    settings.BILLING_SLA_CREDIT_SHARE = 0.5
    reserve(acme, served_model, 100, at(1))  # 720 h: $7,200.00
    used(acme, served_model, at(20, 10), 40.0, guaranteed_mu=40.0, refused=3)  # credit
    used(acme, served_model, at(20, 11), 120.0, guaranteed_mu=120.0, refused=2)  # over: none
    invoice_generate(period="2026-11")
    invoice = invoice_of(acme)
    credit = invoice.lines.get(kind="credit")
    # Half of one minute's commitment: 0.5 × 100 MU/min × $0.10 / 60 = $0.0833 -> $0.08.
    assert credit.amount == Decimal("-0.08")
    (evidence,) = credit.evidence["minutes"]
    assert evidence == {
        "minute": at(20, 10).isoformat(),
        "reserved_mu_per_minute": 100.0,
        "guaranteed_mu_used": 40.0,
        "guaranteed_refused": 3,
    }
    assert (invoice.subtotal, invoice.credits, invoice.total) == (
        Decimal("7200.00"),
        Decimal("0.08"),
        Decimal("7199.92"),
    )


def test_an_amendment_changes_the_commitment_from_its_time(card, served_model, acme):
    # 100 MU/min from 1 Nov, amended to 200 MU/min on 26 Nov: 25 days at 100 (600 h, $6,000)
    # then 5 days at 200 (120 h, $2,400).
    reservation = reserve(acme, served_model, 200, at(1))
    # As the reservation service records them: its creation, then the amendment.
    created = ReservationChange.objects.create(
        reservation=reservation, kind="created", changes={"mu_per_minute": [None, 100]}
    )
    change = ReservationChange.objects.create(
        reservation=reservation, kind="amended", changes={"mu_per_minute": [100, 200]}
    )
    ReservationChange.objects.filter(pk=created.pk).update(
        changed_at=datetime(2026, 10, 30, tzinfo=UTC)
    )
    ReservationChange.objects.filter(pk=change.pk).update(changed_at=at(26))
    invoice_generate(period="2026-11")
    assert sorted(line.amount for line in invoice_of(acme).lines.all()) == [
        Decimal("2400.00"),
        Decimal("6000.00"),
    ]


def test_regenerating_replaces_drafts_and_never_touches_an_issued_invoice(
    card, served_model, acme, globex
):
    reserve(acme, served_model, 100, at(16))
    used(globex, served_model, at(10, 12), 1500.0)
    invoice_generate(period="2026-11")
    first = {i.customer_id: (i.pk, i.total) for i in Invoice.objects.all()}
    invoice_generate(period="2026-11")
    again = {i.customer_id: i.total for i in Invoice.objects.all()}
    assert again == {c: total for c, (_, total) in first.items()}
    assert Invoice.objects.count() == 2

    issued = invoice_issue(invoice=invoice_of(acme))
    lines_before = list(issued.lines.values_list("description", "amount"))
    used(acme, served_model, at(20, 9), 5000.0)  # late usage for an issued month
    result = invoice_generate(period="2026-11")
    assert result.skipped_issued == 1
    issued.refresh_from_db()
    assert (issued.status, issued.total) == ("issued", Decimal("3600.00"))
    assert list(issued.lines.values_list("description", "amount")) == lines_before
    assert Invoice.objects.filter(customer=acme).count() == 1
    with pytest.raises(ConflictError):
        invoice_issue(invoice=issued)


def test_a_used_rate_card_cannot_change_but_a_new_version_can_follow(card, served_model, acme):
    assert (
        rate_card_update(rate_card=card, best_effort_price_per_1000_mu=Decimal("2.00")).pk
        == card.pk
    )
    reserve(acme, served_model, 100, at(16))
    invoice_generate(period="2026-11")
    invoice_issue(invoice=invoice_of(acme))
    with pytest.raises(ConflictError):
        rate_card_update(rate_card=card, reserved_price_per_mu_minute_hour=Decimal("0.01"))
    newer = rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 12, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.09"),
        best_effort_price_per_1000_mu=Decimal("1.80"),
    )
    assert newer.pk != card.pk
    assert InvoiceLine.objects.filter(rate_card=card).exists()


def test_the_command_and_its_errors(card, served_model, acme):
    reserve(acme, served_model, 100, at(16))
    out = StringIO()
    call_command("generate_invoices", "--period", "2026-11", stdout=out)
    assert "1 draft invoice(s)" in out.getvalue()
    with pytest.raises(CommandError, match="YYYY-MM"):
        call_command("generate_invoices", "--period", "November")
    with pytest.raises(CommandError, match="no customer"):
        call_command("generate_invoices", "--period", "2026-11", "--customer", "nobody")


def test_late_usage_for_an_issued_month_is_an_adjustment_on_the_next_invoice(
    card, served_model, globex
):
    used(globex, served_model, at(10, 12), 1500.0)  # $3.00 in November
    invoice_generate(period="2026-11")
    invoice_issue(invoice=invoice_of(globex))
    used(globex, served_model, at(30, 23, 59), 500.0)  # arrives after the issue
    used(globex, served_model, datetime(2026, 12, 2, tzinfo=UTC), 1000.0)  # December: $2.00
    invoice_generate(period="2026-12")
    december = Invoice.objects.get(customer=globex, period_start="2026-12-01")
    adjustment = december.lines.get(kind="adjustment")
    # 500 late MU at November's card: 0.5 × $2.00 = $1.00.
    assert (adjustment.amount, adjustment.evidence["period"]) == (Decimal("1.00"), "2026-11")
    assert december.total == Decimal("3.00")
    assert invoice_of(globex).total == Decimal("3.00")  # November itself never changes
    # Regenerating December does not bill the late usage twice.
    invoice_generate(period="2026-12")
    december = Invoice.objects.get(customer=globex, period_start="2026-12-01")
    assert december.lines.filter(kind="adjustment").count() == 1
    assert december.total == Decimal("3.00")


# --- Keep-warm ------------------------------------------------------------------------------


@pytest.fixture
def warm_card(served_model):
    # $0.10 per MU/min reserved for an hour, and $0.02 more when it is kept warm.
    return rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
        keep_warm_price_per_mu_minute_hour=Decimal("0.02"),
    )


def test_a_keep_warm_reservation_pays_the_premium_on_its_own_line(warm_card, served_model, acme):
    # 100 MU/min kept warm from 16 November: 360 h; the premium 100 × 360 × $0.02 = $720.00
    # beside the commitment's $3,600.00.
    reservation = reserve(acme, served_model, 100, at(16))
    Reservation.objects.filter(pk=reservation.pk).update(keep_warm=True)
    invoice_generate(period="2026-11")
    invoice = invoice_of(acme)
    premium = invoice.lines.get(kind="keep_warm")
    assert (premium.quantity, premium.unit_price, premium.amount) == (
        Decimal("36000"),
        Decimal("0.02"),
        Decimal("720.00"),
    )
    assert premium.reservation_id == reservation.pk
    assert (premium.starts_at, premium.ends_at) == (at(16), datetime(2026, 12, 1, tzinfo=UTC))
    assert "Keep-warm premium" in premium.description
    assert invoice.lines.get(kind="commitment").amount == Decimal("3600.00")
    assert invoice.total == Decimal("4320.00")


def test_a_reservation_without_keep_warm_has_no_premium_line(warm_card, served_model, acme):
    reserve(acme, served_model, 100, at(16))
    invoice_generate(period="2026-11")
    invoice = invoice_of(acme)
    assert [line.kind for line in invoice.lines.all()] == ["commitment"]
    assert invoice.total == Decimal("3600.00")


def test_the_premium_runs_from_the_amendment_that_turned_keep_warm_on(
    warm_card, served_model, acme
):
    # 100 MU/min all November; keep-warm from 21 November: 240 h × 100 × $0.02 = $480.00.
    reservation = reserve(acme, served_model, 100, at(1))
    Reservation.objects.filter(pk=reservation.pk).update(keep_warm=True)
    change = ReservationChange.objects.create(
        reservation=reservation, kind="amended", changes={"keep_warm": [False, True]}
    )
    ReservationChange.objects.filter(pk=change.pk).update(changed_at=at(21))
    invoice_generate(period="2026-11")
    premium = invoice_of(acme).lines.get(kind="keep_warm")
    assert (premium.starts_at, premium.amount) == (at(21), Decimal("480.00"))
    # The commitment is not split by it.
    assert invoice_of(acme).lines.get(kind="commitment").amount == Decimal("7200.00")


def test_a_card_without_a_keep_warm_price_bills_no_premium(card, served_model, acme):
    reservation = reserve(acme, served_model, 100, at(16))
    Reservation.objects.filter(pk=reservation.pk).update(keep_warm=True)
    invoice_generate(period="2026-11")
    assert [line.kind for line in invoice_of(acme).lines.all()] == ["commitment"]

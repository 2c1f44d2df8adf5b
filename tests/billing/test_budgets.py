"""Budgets and spend alerts (issue 23 part 2): alerts at 50, 80 and 100 % once each, by mail
and signed webhook; a week under 20 % of a reservation alerts once; the hard cap refuses
best-effort admission past 100 % while the reservation still admits."""

import json
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import redis
import time_machine
from django.core import mail
from django.db import connection

from accounts import scopes as S
from billing.budgets import budget_create, budget_update, budgets_check
from billing.models import BudgetAlert
from billing.rates import rate_card_create
from capacity.admission import gate as admission
from capacity.allocation.policy import Allowance
from capacity.models import BudgetCap, Reservation, UsageMinute
from core.models import AuditEntry
from tests.support.admission import publish_allowances, reserve
from tests.support.processes import free_port
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = [pytest.mark.django_db]

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
SECRET = "alert-secret"
SMALL = {"input_tokens": 100, "max_tokens": 10}


@pytest.fixture
def card(served_model):
    # $2.00 per 1,000 best-effort MU: 1,000 MU cost $2.00.
    return rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )


@pytest.fixture
def receiver(settings):
    server = WebhookReceiver(secret=SECRET).start()
    settings.ALERT_WEBHOOK_URL = server.url
    settings.ALERT_WEBHOOK_SECRET = SECRET
    yield server
    server.stop()


@pytest.fixture
def clean_admission(settings):
    """No cached models or admission keys from other tests; yields the admission Redis."""
    admission.reset()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    keys = list(client.scan_iter("adm:*"))
    if keys:
        client.delete(*keys)
    yield client
    admission.reset()


@pytest.fixture
def owner_with_mail(owner):
    owner.email = "owner@acme.example"
    owner.save()
    return owner


def spend(customer, model, dollars, minute=None):
    """Best-effort usage worth `dollars` at the card's $2 per 1,000 MU."""
    UsageMinute.objects.create(
        customer=customer,
        served_model=model,
        minute=minute or NOW - timedelta(hours=len(UsageMinute.objects.all()) + 1),
        requests=1,
        mu=float(dollars) * 500,
        best_effort_mu=float(dollars) * 500,
    )


def check(capture):
    with time_machine.travel(NOW, tick=False), capture(execute=True):
        return budgets_check()


def test_alerts_fire_once_per_threshold_by_mail_and_webhook(
    card, served_model, acme, owner_with_mail, receiver, django_capture_on_commit_callbacks
):
    budget = budget_create(customer=acme, monthly_amount=Decimal("100"))
    spend(acme, served_model, 60)  # $60 of $100
    check(django_capture_on_commit_callbacks)
    assert [m.subject for m in mail.outbox] == ["[acme] 50 % of the monthly budget spent (2026-11)"]
    assert mail.outbox[0].to == ["owner@acme.example"]
    assert "60.00 USD of its monthly budget of 100.00 USD" in mail.outbox[0].body
    assert [r.status for r in receiver.received] == [200]  # signed, the receiver checked
    assert b'"threshold_percent":50' in receiver.received[0].raw_body

    check(django_capture_on_commit_callbacks)  # again: nothing more
    assert len(mail.outbox) == 1 and len(receiver.received) == 1

    spend(acme, served_model, 25)  # $85: only 80 is new
    check(django_capture_on_commit_callbacks)
    assert [m.subject[:14] for m in mail.outbox] == ["[acme] 50 % of", "[acme] 80 % of"]
    assert len(receiver.received) == 2
    rows = BudgetAlert.objects.filter(budget=budget).order_by("threshold_percent", "channel")
    assert [(a.threshold_percent, a.channel, a.sent_at is not None) for a in rows] == [
        (50, "email", True),
        (50, "webhook", True),
        (80, "email", True),
        (80, "webhook", True),
    ]


def test_the_100_percent_alert_goes_once_by_mail_and_by_webhook(
    card, served_model, acme, owner_with_mail, receiver, django_capture_on_commit_callbacks
):
    budget = budget_create(customer=acme, monthly_amount=Decimal("100"), hard_cap=True)
    spend(acme, served_model, 85)
    check(django_capture_on_commit_callbacks)  # 50 and 80
    assert len(mail.outbox) == 2 and len(receiver.received) == 2

    spend(acme, served_model, 20)  # $105 of $100
    check(django_capture_on_commit_callbacks)

    assert len(mail.outbox) == 3
    message = mail.outbox[2]
    assert message.subject == "[acme] 100 % of the monthly budget spent (2026-11)"
    assert message.to == ["owner@acme.example"]
    assert "105.00 USD of its monthly budget of 100.00 USD in 2026-11 (105.0 %)" in message.body
    assert "hard cap is on: requests beyond the reservations (best-effort) are refused" in (
        message.body
    )
    assert len(receiver.received) == 3
    hook = json.loads(receiver.received[2].raw_body)
    assert (hook["kind"], hook["threshold_percent"], hook["customer"], hook["spend"]) == (
        "billing_budget",
        100,
        "acme",
        "105.00",
    )
    assert receiver.received[2].status == 200  # signed with the secret, the receiver checked
    sent = BudgetAlert.objects.filter(budget=budget, threshold_percent=100)
    assert sorted((a.channel, a.sent_at is not None, a.error) for a in sent) == [
        ("email", True, ""),
        ("webhook", True, ""),
    ]

    check(django_capture_on_commit_callbacks)  # past 100 % still: nothing is sent again
    assert len(mail.outbox) == 3 and len(receiver.received) == 3


def test_a_budgets_alert_email_goes_through_a_real_smtp_server(
    card, served_model, acme, settings, django_capture_on_commit_callbacks
):
    from aiosmtpd.controller import Controller

    class Inbox:
        def __init__(self):
            self.messages = []

        async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's name
            self.messages.append((envelope.rcpt_tos, envelope.content.decode()))
            return "250 OK"

    inbox = Inbox()
    port = free_port()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
        settings.EMAIL_HOST = "127.0.0.1"
        settings.EMAIL_PORT = port
        settings.DEFAULT_FROM_EMAIL = "alerts@control-plane.example"
        budget_create(customer=acme, monthly_amount=Decimal("10"), alert_email="fin@acme.example")
        spend(acme, served_model, 6)
        check(django_capture_on_commit_callbacks)
    finally:
        controller.stop()
    ((to, content),) = inbox.messages
    assert to == ["fin@acme.example"]
    assert "Subject: [acme] 50 % of the monthly budget spent (2026-11)" in content
    assert "From: alerts@control-plane.example" in content
    assert BudgetAlert.objects.get().sent_at is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql_only
def test_concurrent_checks_send_each_alert_exactly_once(
    card, served_model, acme, owner_with_mail, receiver
):
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL")
    budget_create(customer=acme, monthly_amount=Decimal("100"))
    spend(acme, served_model, 90)  # 50 and 80
    barrier = threading.Barrier(2)
    errors = []

    def run():
        try:
            barrier.wait(timeout=10)
            with time_machine.travel(NOW, tick=False):
                budgets_check()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert sorted(m.subject[7:9] for m in mail.outbox) == ["50", "80"]
    assert len(receiver.received) == 2
    assert BudgetAlert.objects.count() == 4


def test_the_hard_cap_refuses_best_effort_past_100_percent_and_keeps_the_reservation(
    card,
    sellable,
    served_model,
    acme,
    make_key,
    key_client,
    clean_admission,
    django_capture_on_commit_callbacks,
):
    _, plaintext = make_key(customer=acme, scopes=[S.ADMISSION])
    client = key_client(plaintext)
    # A guaranteed bucket of 6 MU/min (1 MU of burst: one small request), best-effort beyond.
    reserve(acme, served_model, 6.0)  # sold: the floor every publication writes
    publish_allowances([Allowance(acme.pk, served_model.pk, 6.0, 600.0)])
    body = {"model": served_model.name, **SMALL}

    with django_capture_on_commit_callbacks(execute=True):
        budget = budget_create(customer=acme, monthly_amount=Decimal("100"), hard_cap=True)
    spend(acme, served_model, 99)  # under 100 %: best-effort admitted
    check(django_capture_on_commit_callbacks)
    assert not BudgetCap.objects.exists()
    classes = [client.post("/api/v1/admission", body, format="json").json()["class"]
               for _ in range(2)]  # fmt: skip
    assert classes == ["guaranteed", "best_effort"]

    spend(acme, served_model, 2)  # $101
    check(django_capture_on_commit_callbacks)
    assert BudgetCap.objects.filter(customer=acme).exists()
    assert AuditEntry.objects.filter(action="budget_cap.set").exists()
    clean_admission.delete(*clean_admission.keys("adm:g:*"), *clean_admission.keys("adm:be:*"))
    guaranteed = client.post("/api/v1/admission", body, format="json")
    assert (guaranteed.status_code, guaranteed.json()["class"]) == (200, "guaranteed")
    refused = client.post("/api/v1/admission", body, format="json")
    assert refused.status_code == 429
    assert refused.json()["limit"] == "budget"
    assert "budget is spent" in refused.json()["reason"]

    # The cap turned off lifts it at once.
    with django_capture_on_commit_callbacks(execute=True), time_machine.travel(NOW, tick=False):
        budget_update(budget=budget, changes={"hard_cap": False})
    assert not BudgetCap.objects.exists()
    clean_admission.delete(*clean_admission.keys("adm:g:*"))
    client.post("/api/v1/admission", body, format="json")  # the guarantee's burst
    again = client.post("/api/v1/admission", body, format="json")
    assert (again.status_code, again.json()["class"]) == (200, "best_effort")


def test_a_reservation_under_20_percent_for_a_week_alerts_once(
    card, served_model, acme, owner_with_mail, receiver, django_capture_on_commit_callbacks
):
    reservation = Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=100,
        starts_at=NOW - timedelta(days=10),
        status="active",
    )
    # 10 MU/min on average over the week: 10 % of 100 MU/min.
    UsageMinute.objects.create(
        customer=acme,
        served_model=served_model,
        minute=NOW - timedelta(days=1),
        requests=1,
        mu=10 * 7 * 24 * 60,
        guaranteed_mu=10 * 7 * 24 * 60,
    )
    check(django_capture_on_commit_callbacks)
    check(django_capture_on_commit_callbacks)
    assert len(mail.outbox) == 1
    assert f"reservation #{reservation.pk} used 10.0 %" in mail.outbox[0].subject
    assert len(receiver.received) == 1
    assert b'"kind":"billing_underuse"' in receiver.received[0].raw_body


def test_a_well_used_reservation_sends_nothing(
    card, served_model, acme, owner_with_mail, django_capture_on_commit_callbacks
):
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=1,
        starts_at=NOW - timedelta(days=10),
        status="active",
    )
    UsageMinute.objects.create(
        customer=acme, served_model=served_model, minute=NOW - timedelta(days=1),
        requests=1, mu=0.5 * 7 * 24 * 60, guaranteed_mu=0.5 * 7 * 24 * 60,
    )  # fmt: skip
    check(django_capture_on_commit_callbacks)
    assert mail.outbox == []


def test_budgets_through_the_api_planners_write_customers_read_their_own_only(
    planner_client, owner_client, outsider_client, member_client, acme, globex
):
    created = planner_client.post(
        "/api/v1/budgets/",
        {"customer": "acme", "monthly_amount": "250.00", "hard_cap": True},
        format="json",
    )
    assert created.status_code == 201, created.json()
    pk = created.json()["id"]
    assert created.json()["currency"] == "USD"
    assert AuditEntry.objects.filter(action="budget.create").exists()
    assert (
        planner_client.post(
            "/api/v1/budgets/", {"customer": "acme", "monthly_amount": "1"}, format="json"
        ).status_code
        == 409
    )
    bad = planner_client.post(
        "/api/v1/budgets/", {"customer": "globex", "monthly_amount": "0"}, format="json"
    )
    assert bad.status_code == 400 and "monthly_amount" in str(bad.json())

    assert owner_client.get(f"/api/v1/budgets/{pk}/").json()["monthly_amount"] == "250.00"
    spend_now = member_client.get(f"/api/v1/budgets/{pk}/spend/").json()
    assert (spend_now["spend"], spend_now["capped"]) == ("0.00", False)
    assert outsider_client.get(f"/api/v1/budgets/{pk}/").status_code == 404
    assert outsider_client.get(f"/api/v1/budgets/{pk}/spend/").status_code == 404
    assert outsider_client.get("/api/v1/budgets/").json()["results"] == []
    assert (
        owner_client.patch(
            f"/api/v1/budgets/{pk}/", {"monthly_amount": "1"}, format="json"
        ).status_code
        == 403
    )

    changed = planner_client.patch(
        f"/api/v1/budgets/{pk}/", {"monthly_amount": "300"}, format="json"
    )
    assert changed.json()["monthly_amount"] == "300.00"
    assert AuditEntry.objects.filter(action="budget.update").exists()


def test_the_portal_limits_page_shows_the_budget_and_spend(owner_client, acme):
    budget_create(customer=acme, monthly_amount=Decimal("250"))
    page = owner_client.get("/portal/acme/limits/").content.decode()
    assert "Monthly budget" in page
    assert "250.00 USD" in page

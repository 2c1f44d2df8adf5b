"""Budgets per API key (issue 23 part 2, "optionally per key"): a usage event records the key
its admission record names (never the sender's word), a key's budget is spent by the requests
sent with that key, alerts at 50, 80 and 100 % go once each, and the hard cap on a key's budget
refuses that key's best-effort requests while the customer's other keys are admitted."""

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import redis
from django.core import mail
from django.utils import timezone

from accounts import scopes as S
from billing.budgets import budget_create, budget_update, budgets_check
from billing.models import BudgetAlert
from billing.rates import rate_card_create
from capacity.admission import gate as admission
from capacity.allocation.policy import Allowance
from capacity.metering.rollups import direct_key_aggregation, usage_rollup
from capacity.models import BudgetCap, UsageEvent, UsageKeyMinute
from core.models import AuditEntry
from tests.support.admission import publish_allowances, reserve
from tests.support.usage import USAGE, gateway_client, store_events
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

SECRET = "alert-secret"
# 450 input and 5 output tokens: 0.45 + 0.10 + 0.05 = 0.6 replica-seconds of SIMPLE_WEIGHTS,
# 1 MU (R = 100 MU/min); at $100 per 1,000 best-effort MU each such request costs $0.10.
ONE_MU = {"input_tokens": 450, "max_tokens": 5}
SMALL = {"input_tokens": 100, "max_tokens": 10}  # 0.58 MU


@pytest.fixture
def card(served_model):
    return rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("100.00"),
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
    admission.reset()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    keys = list(client.scan_iter("adm:*"))
    if keys:
        client.delete(*keys)
    yield client
    admission.reset()


@pytest.fixture
def two_keys(acme, make_key, key_client):
    """Two of acme's keys that ask for admission: (ApiKey, client) each."""
    made = [make_key(customer=acme, name=name, scopes=[S.ADMISSION]) for name in ("ci", "web")]
    return [(api_key, key_client(plaintext)) for api_key, plaintext in made]


def admitted(client, model, request_id=None, shape=ONE_MU):
    body = {"model": model.name, **shape}
    if request_id:
        body["request_id"] = request_id
    return client.post("/api/v1/admission", body, format="json")


def send(key_client_, gateway, model, count, *, claim=None):
    """`count` requests admitted with the key, then reported by the platform's gateway as it
    reports them (a request id each, 450 in / 5 out); `claim`: the key the gateway names."""
    now = timezone.now()
    events = []
    for _ in range(count):
        request_id = uuid.uuid4().hex
        answer = admitted(key_client_, model, request_id)
        assert answer.status_code == 200, answer.json()
        event = {
            "event_id": request_id,
            "customer": "acme",
            "model": model.name,
            "started_at": (now - timedelta(seconds=2)).isoformat(),
            "finished_at": now.isoformat(),
            "input_tokens": 450,
            "output_tokens": 5,
            "outcome": "completed",
        }
        if claim is not None:
            event["api_key"] = claim
        events.append(event)
    response = gateway.post(USAGE, {"events": events}, format="json")
    assert response.json()["accepted_count"] == count, response.json()
    return [event["event_id"] for event in events]


def check(capture):
    with capture(execute=True):
        return budgets_check()


def test_a_usage_event_keeps_the_key_its_admission_recorded_whatever_the_sender_claims(
    card,
    sellable,
    served_model,
    acme,
    two_keys,
    make_key,
    key_client,
    clean_admission,
    planner_client,
):
    (ci, ci_client), (web, _) = two_keys
    gateway = gateway_client(make_key, key_client)
    publish_allowances([Allowance(acme.pk, served_model.pk, 0.0, 6000.0)])

    (honest,) = send(ci_client, gateway, served_model, 1, claim=ci.prefix)
    (lying,) = send(ci_client, gateway, served_model, 1, claim=web.prefix)
    silent_id = uuid.uuid4().hex  # never admitted: no record, whatever it claims
    now = timezone.now()
    gateway.post(
        USAGE,
        {"events": [{"event_id": silent_id, "customer": "acme", "model": served_model.name,
                     "started_at": now.isoformat(), "finished_at": now.isoformat(),
                     "input_tokens": 450, "output_tokens": 5, "outcome": "completed",
                     "api_key": web.prefix}]},
        format="json",
    )  # fmt: skip

    stored = {e.event_id: e for e in UsageEvent.objects.all()}
    assert (stored[honest].api_key_prefix, stored[honest].verification) == (ci.prefix, "recorded")
    # The record decides; the contradiction is flagged (shown on the invoice as unverified).
    assert (stored[lying].api_key_prefix, stored[lying].verification) == (
        ci.prefix,
        "contradicted",
    )
    assert (stored[silent_id].api_key_prefix, stored[silent_id].verification) == (
        "",
        "unrecorded",
    )
    # The customer audits it in its receipts, and sees the key in the portal.
    receipts = planner_client.get("/api/v1/usage/events?customer=acme").json()["results"]
    assert {r["event_id"]: r["api_key"] for r in receipts} == {
        honest: ci.prefix,
        lying: ci.prefix,
        silent_id: None,
    }
    csv_text = b"".join(
        planner_client.get("/api/v1/usage/events/csv?customer=acme").streaming_content
    ).decode()
    assert "api_key" in csv_text.splitlines()[0] and ci.prefix in csv_text


def test_a_keys_budget_is_spent_by_its_own_requests_and_alerts_once_per_threshold(
    card,
    sellable,
    served_model,
    acme,
    owner,
    two_keys,
    make_key,
    key_client,
    clean_admission,
    receiver,
    planner_client,
    django_capture_on_commit_callbacks,
):
    owner.email = "owner@acme.example"
    owner.save()
    (ci, ci_client), (web, web_client) = two_keys
    gateway = gateway_client(make_key, key_client)
    publish_allowances([Allowance(acme.pk, served_model.pk, 0.0, 6000.0)])
    made = planner_client.post(
        "/api/v1/budgets/",
        {"customer": "acme", "api_key": ci.prefix, "monthly_amount": "1.00"},
        format="json",
    )
    assert made.status_code == 201, made.json()
    assert made.json()["api_key"] == ci.prefix
    key_budget = made.json()["id"]
    customer_budget = budget_create(customer=acme, monthly_amount=Decimal("100"))

    send(ci_client, gateway, served_model, 5)  # $0.50 with the ci key
    send(web_client, gateway, served_model, 3)  # $0.30 with the web key: not the ci key's
    usage_rollup()
    requests_by_key: dict[str, int] = {}
    for row in UsageKeyMinute.objects.all():
        requests_by_key[row.api_key_prefix] = requests_by_key.get(row.api_key_prefix, 0) + (
            row.requests
        )
    assert requests_by_key == {ci.prefix: 5, web.prefix: 3}
    check(django_capture_on_commit_callbacks)

    assert [m.subject for m in mail.outbox] == [
        f"[acme] key {ci.prefix}: 50 % of its monthly budget spent ({timezone.now():%Y-%m})"
    ]
    assert "0.50 USD" in mail.outbox[0].body and ci.prefix in mail.outbox[0].body
    assert len(receiver.received) == 1
    assert f'"api_key":"{ci.prefix}"'.encode() in receiver.received[0].raw_body
    spend = planner_client.get(f"/api/v1/budgets/{key_budget}/spend/").json()
    assert (spend["api_key"], spend["spend"], spend["percent"]) == (ci.prefix, "0.50", 50.0)
    # The customer's budget counts every key's requests: $0.80 of $100, no alert.
    whole = planner_client.get(f"/api/v1/budgets/{customer_budget.pk}/spend/").json()
    assert (whole["api_key"], whole["spend"]) == (None, "0.80")

    check(django_capture_on_commit_callbacks)  # again: nothing more
    assert len(mail.outbox) == 1 and len(receiver.received) == 1

    send(ci_client, gateway, served_model, 5)  # $1.00: 80 and 100 are new
    usage_rollup()
    check(django_capture_on_commit_callbacks)
    assert [m.subject.split(": ")[1][:4] for m in mail.outbox] == ["50 %", "80 %", "100 "]
    assert len(receiver.received) == 3
    rows = BudgetAlert.objects.filter(budget_id=key_budget).order_by("threshold_percent", "channel")
    assert [(a.threshold_percent, a.channel, a.sent_at is not None) for a in rows] == [
        (50, "email", True), (50, "webhook", True), (80, "email", True),
        (80, "webhook", True), (100, "email", True), (100, "webhook", True),
    ]  # fmt: skip
    assert not BudgetAlert.objects.filter(budget=customer_budget).exists()
    assert not BudgetCap.objects.exists()  # no hard cap asked for


def test_a_key_past_its_capped_budget_is_refused_best_effort_while_another_key_is_admitted(
    card,
    sellable,
    served_model,
    gpu_type,
    acme,
    two_keys,
    clean_admission,
    django_capture_on_commit_callbacks,
):
    (ci, ci_client), (web, web_client) = two_keys
    # A guaranteed bucket of 6 MU/min (1 MU of burst: one small request), best-effort beyond.
    reserve(acme, served_model, 6.0)  # sold: the floor every publication writes
    publish_allowances([Allowance(acme.pk, served_model.pk, 6.0, 600.0)])
    with django_capture_on_commit_callbacks(execute=True):
        budget = budget_create(
            customer=acme, api_key=ci, monthly_amount=Decimal("0.50"), hard_cap=True
        )
    # $0.50 of best-effort usage sent with the ci key this month (5 × 1 MU).
    now = timezone.now()
    store_events(
        [{"event_id": f"ci-{n}", "customer_id": acme.pk, "served_model_id": served_model.pk,
          "cost_model_id": sellable.pk, "finished_at": now - timedelta(seconds=n),
          "api_key_prefix": ci.prefix, "mu": 1.0} for n in range(5)]
    )  # fmt: skip
    usage_rollup()
    # The key rollup is what the raw events add up to.
    assert direct_key_aggregation(customer=acme)
    assert {
        k: (v["requests"], round(v["best_effort_mu"], 6))
        for k, v in direct_key_aggregation(customer=acme).items()
    } == {
        (row.customer_id, row.api_key_prefix, row.served_model_id, row.minute): (
            row.requests, round(row.best_effort_mu, 6)
        )
        for row in UsageKeyMinute.objects.all()
    }  # fmt: skip

    check(django_capture_on_commit_callbacks)
    cap = BudgetCap.objects.get()
    assert (cap.customer_id, cap.api_key_id) == (acme.pk, ci.pk)
    assert AuditEntry.objects.get(action="budget_cap.set").after["api_key"] == ci.prefix

    first = admitted(ci_client, served_model, shape=SMALL)
    assert (first.status_code, first.json()["class"]) == (200, "guaranteed")
    refused = admitted(ci_client, served_model, shape=SMALL)
    assert refused.status_code == 429, refused.json()
    body = refused.json()
    assert (body["limit"], body["limit_scope"]) == ("budget", "api_key")
    assert "the API key's monthly budget is spent" in body["reason"]
    # The customer's other key is not capped: what is left of the guarantee, the rest
    # best-effort.
    other = admitted(web_client, served_model, shape=SMALL)
    assert (other.status_code, other.json()["class"]) == (200, "best_effort")

    # Raising the key's budget lifts its cap at once.
    with django_capture_on_commit_callbacks(execute=True):
        budget_update(budget=budget, changes={"monthly_amount": Decimal("5.00")})
    assert not BudgetCap.objects.exists()
    again = admitted(ci_client, served_model, shape=SMALL)
    assert (again.status_code, again.json()["class"]) == (200, "best_effort")


def test_a_keys_budget_names_one_of_the_customers_keys_once(planner_client, acme, globex, make_key):
    mine, _ = make_key(customer=acme)
    theirs, _ = make_key(customer=globex)
    made = planner_client.post(
        "/api/v1/budgets/",
        {"customer": "acme", "api_key": mine.prefix, "monthly_amount": "10"},
        format="json",
    )
    assert made.status_code == 201
    assert AuditEntry.objects.get(action="budget.create").after["api_key"] == mine.prefix
    again = planner_client.post(
        "/api/v1/budgets/",
        {"customer": "acme", "api_key": mine.prefix, "monthly_amount": "20"},
        format="json",
    )
    assert again.status_code == 409 and "api_key" in str(again.json())
    # The customer's own budget is another one: both may exist.
    assert (
        planner_client.post(
            "/api/v1/budgets/", {"customer": "acme", "monthly_amount": "50"}, format="json"
        ).status_code
        == 201
    )
    wrong = planner_client.post(
        "/api/v1/budgets/",
        {"customer": "acme", "api_key": theirs.prefix, "monthly_amount": "10"},
        format="json",
    )
    assert wrong.status_code == 400 and "api_key" in str(wrong.json())
    listed = planner_client.get(f"/api/v1/budgets/?api_key={mine.prefix}").json()["results"]
    assert [(b["customer"], b["api_key"]) for b in listed] == [("acme", mine.prefix)]

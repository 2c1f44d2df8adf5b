"""A customer cannot set its own bill: the admission record of a request decides the class its
usage event is billed in, event ids are per customer, and a customer's own keys report usage
only when a planner allows it (issue 15's reproductions, through the real API, Redis and
billing)."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from accounts import scopes as S
from billing.generation import invoice_generate
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.admission import gate as admission
from capacity.admission.redis_layout import record_key
from capacity.metering.rollups import usage_rollup
from capacity.models import FallbackAdmission, Reservation, UsageEvent, UsageMinute
from tests.capacity.admission.test_admission import (
    SMALL,
    ask,
    limits,
    private_redis,
)
from tests.support.admission import reserve
from tests.support.usage import gateway_client

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]
URL = "/api/v1/usage/events"
__all__ = ["private_redis"]  # a fixture used here


def event(event_id, customer="acme", **overrides) -> dict:
    finished = timezone.now() - timedelta(seconds=5)
    return {
        "event_id": event_id,
        "customer": customer,
        "model": "llama-8b",
        "started_at": (finished - timedelta(seconds=2)).isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": 100,
        "output_tokens": 10,
        "outcome": "completed",
    } | overrides


@pytest.fixture
def gateway(make_key, key_client):
    return gateway_client(make_key, key_client, scopes=[S.USAGE_WRITE, S.ADMISSION])


@pytest.fixture
def card(served_model):
    # $0.10 per MU/min-hour reserved; $2.00 per 1,000 best-effort MU.
    return rate_card_create(
        served_model=served_model,
        effective_from=timezone.now() - timedelta(days=62),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )


def post(client, *events):
    return client.post(URL, {"events": list(events)}, format="json")


def invoice_now(customer) -> Invoice:
    period = timezone.now().date()
    usage_rollup()
    invoice_generate(period=period)
    return Invoice.objects.get(customer=customer, period_start=period.replace(day=1))


def test_a_forged_guaranteed_refusal_earns_no_credit_but_a_real_one_does(
    sellable, served_model, acme, gateway, card
):
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=6,
        starts_at=timezone.now() - timedelta(days=1),
        status="active",
    )
    limits(acme, served_model, 6.0, 0.0)
    # Forged: refusals admission never made, labelled guaranteed to claim the SLA credit.
    forged = [
        event(f"forged-{i}", outcome="refused", admission_class="guaranteed") for i in range(5)
    ]
    assert post(gateway, *forged).status_code == 200
    stored = UsageEvent.objects.filter(event_id__startswith="forged-")
    assert {(e.admission_class, e.verification) for e in stored} == {("best_effort", "unrecorded")}
    assert not invoice_now(acme).lines.filter(kind="credit").exists()

    # A real one: the guaranteed bucket (1 MU of burst) runs dry, admission refuses.
    assert ask(acme, served_model, request_id="ok-1", input_tokens=100, max_tokens=40).admitted
    refusal = ask(acme, served_model, request_id="real-refusal", **SMALL)
    assert refusal.admission_class == "refused"
    assert post(gateway, event("real-refusal", outcome="refused")).status_code == 200
    real = UsageEvent.objects.get(event_id="real-refusal")
    assert (real.admission_class, real.verification) == ("guaranteed", "recorded")
    credits = invoice_now(acme).lines.filter(kind="credit")
    assert credits.count() == 1


def test_labelling_best_effort_usage_guaranteed_keeps_its_best_effort_charge(
    sellable, served_model, acme, gateway, card
):
    # 6 MU/min guaranteed (1 MU of burst), plenty of best-effort: the first request is
    # guaranteed, the rest best-effort — whatever the events later claim.
    limits(acme, served_model, 6.0, 600.0)
    classes = [
        ask(acme, served_model, request_id=f"r{i}", input_tokens=100, max_tokens=20).admission_class
        for i in range(4)
    ]
    # r1 took what r0 left of the burst, the rest best-effort (partial spillover).
    assert classes == ["guaranteed", "best_effort", "best_effort", "best_effort"]
    answer = post(gateway, *(event(f"r{i}", admission_class="guaranteed") for i in range(4)))
    assert answer.status_code == 200, answer.json()
    stored = {e.event_id: e for e in UsageEvent.objects.all()}
    assert [stored[f"r{i}"].admission_class for i in range(4)] == classes
    assert stored["r0"].verification == "recorded"
    assert {stored[f"r{i}"].verification for i in (1, 2, 3)} == {"contradicted"}
    # What the guarantee did not cover is billed best-effort, whatever the events claimed.
    assert stored["r0"].guaranteed_mu == stored["r0"].mu
    assert 0 < stored["r1"].guaranteed_mu < stored["r1"].mu
    for e in stored.values():
        assert e.guaranteed_mu + e.best_effort_mu == pytest.approx(e.mu)
    best_effort_mu = sum(stored[f"r{i}"].best_effort_mu for i in (1, 2, 3))
    (line,) = invoice_now(acme).lines.filter(kind="best_effort")
    assert line.evidence["mu"] == pytest.approx(best_effort_mu)
    assert line.amount == Decimal(str(round(best_effort_mu / 1000 * 2.0, 2)))


def test_an_admitted_request_reported_as_refused_is_rejected(sellable, served_model, acme, gateway):
    limits(acme, served_model, 600.0, 0.0)
    assert ask(acme, served_model, request_id="ran", **SMALL).admitted
    answer = post(gateway, event("ran", outcome="refused"))
    assert answer.status_code == 400
    (rejected,) = answer.json()["rejected"]
    assert rejected["reasons"][0].startswith("outcome: admission admitted request 'ran'")
    assert not UsageEvent.objects.exists()


def test_a_request_that_ran_although_refused_is_billed_best_effort_and_flagged(
    sellable, served_model, acme, gateway
):
    limits(acme, served_model, 0.0, 0.0)
    assert not ask(acme, served_model, request_id="ignored-refusal", **SMALL).admitted
    assert post(gateway, event("ignored-refusal")).status_code == 200
    stored = UsageEvent.objects.get(event_id="ignored-refusal")
    assert (stored.outcome, stored.admission_class, stored.verification) == (
        "completed",
        "best_effort",
        "contradicted",
    )
    usage_rollup()
    assert UsageMinute.objects.get(customer=acme).unverified_mu == pytest.approx(stored.mu)


def test_records_outlive_their_settlement_for_the_whole_lateness_window(
    sellable, served_model, acme, gateway, clean_admission
):
    limits(acme, served_model, 600.0, 0.0)
    assert ask(acme, served_model, request_id="kept", **SMALL).admitted
    assert post(gateway, event("kept")).status_code == 200
    key = record_key(acme.pk, served_model.pk, "kept")
    # Settled (":s") and still there, kept at least as long as events may arrive late.
    assert clean_admission.get(key).decode().endswith(":s")
    assert clean_admission.ttl(key) > django_settings.USAGE_LATENESS_WINDOW_HOURS * 3600
    refused_key = record_key(acme.pk, served_model.pk, "no")
    limits(acme, served_model, 0.0, 0.0)
    assert not ask(acme, served_model, request_id="no", **SMALL).admitted
    assert clean_admission.get(refused_key).decode().startswith("refused:")


def test_usage_is_refused_with_503_and_nothing_stored_while_records_cannot_be_read(
    sellable, served_model, acme, gateway, settings
):
    settings.ADMISSION_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    admission.reset()
    answer = post(gateway, event("while-down"))
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "admission_store_unavailable"
    assert not UsageEvent.objects.exists()


def test_the_redis_down_fallback_spools_its_records_and_they_price_the_events(
    sellable, served_model, acme, gateway, private_redis, make_key
):
    stop, restart = private_redis
    # What is sold decides the fallback (no tick has run).
    reserve(acme, served_model, 600.0)
    api_key, _ = make_key(customer=acme, scopes=[S.ADMISSION])
    stop()
    decision = admission.admit(
        customer_id=acme.pk,
        model=served_model.name,
        request_id="during-outage",
        api_key_prefix=api_key.prefix,
        **SMALL,
    )
    assert (decision.admission_class, decision.degraded) == ("guaranteed", True)
    spooled = FallbackAdmission.objects.get(request_id="during-outage")
    assert (spooled.admission_class, spooled.api_key_prefix) == ("guaranteed", api_key.prefix)
    restart()  # an empty Redis: the record is only in the spool
    admission.reset()
    assert post(gateway, event("during-outage")).status_code == 200
    stored = UsageEvent.objects.get(event_id="during-outage")
    assert (stored.admission_class, stored.verification) == ("guaranteed", "fallback")
    # The spooled record names the key too: a key's budget counts the outage's requests.
    assert stored.api_key_prefix == api_key.prefix


def test_event_ids_are_unique_per_customer_not_across_tenants(
    sellable, served_model, acme, globex, gateway
):
    first = post(gateway, event("shared", customer="acme")).json()
    second = post(gateway, event("shared", customer="globex")).json()
    # globex is not told that acme already used the id, and its event is counted.
    assert (first["accepted"], second["accepted"]) == (["shared"], ["shared"])
    assert second["duplicates"] == []
    both = post(gateway, event("shared", customer="acme"), event("shared", customer="globex"))
    assert both.json()["duplicate_count"] == 2
    assert sorted(UsageEvent.objects.values_list("customer__slug", flat=True)) == [
        "acme",
        "globex",
    ]


def test_a_customer_reports_its_own_usage_only_when_a_planner_allows_it(
    sellable, served_model, acme, owner_client, planner_client, make_key, key_client, card
):
    # Not allowed: not even its owner can mint a key that posts usage.
    minted = owner_client.post(
        "/api/v1/api-keys/",
        {"name": "own gateway", "customer": "acme", "scopes": ["read", "usage:write"]},
        format="json",
    )
    assert minted.status_code == 400
    assert minted.json()["error"]["fields"]["scopes"][0].startswith(
        "Customer 'acme' may not report its own usage"
    )
    allowed = planner_client.patch(
        "/api/v1/customers/acme/", {"may_report_own_usage": True}, format="json"
    )
    assert allowed.status_code == 200, allowed.json()
    minted = owner_client.post(
        "/api/v1/api-keys/",
        {"name": "own gateway", "customer": "acme", "scopes": ["read", "usage:write"]},
        format="json",
    )
    assert minted.status_code == 201
    own = key_client(minted.json()["key"])
    assert post(own, event("mine", customer=None)).status_code == 200
    stored = UsageEvent.objects.get(event_id="mine")
    assert (stored.self_reported, stored.admission_class) == (True, "best_effort")
    (line,) = invoice_now(acme).lines.filter(kind="best_effort")
    assert "self-reported" in line.description
    assert line.evidence["self_reported_mu"] == pytest.approx(stored.mu)

    # Withdrawn: the key still holds the scope, but its posts are refused.
    planner_client.patch("/api/v1/customers/acme/", {"may_report_own_usage": False}, format="json")
    refused = post(own, event("mine-2", customer=None))
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "usage_self_report_not_allowed"


def test_a_refused_event_keeps_the_control_planes_estimate_not_the_senders(
    sellable, served_model, acme, gateway
):
    limits(acme, served_model, 0.0, 0.0)  # nothing may run: admission refuses
    refusal = ask(acme, served_model, request_id="turned-away", **SMALL)
    assert refusal.admission_class == "refused"

    # The sender claims a huge estimate; the admission record's own one is kept.
    answer = post(gateway, event("turned-away", outcome="refused", estimated_mu=999.0))
    assert answer.status_code == 200, answer.json()
    stored = UsageEvent.objects.get(event_id="turned-away")
    assert stored.mu == 0  # it used nothing, and is billed nothing
    assert stored.estimated_mu == pytest.approx(refusal.estimated_mu)
    usage_rollup()
    minute = UsageMinute.objects.get(customer=acme)
    assert (minute.refused_requests, minute.mu) == (1, 0)
    assert minute.refused_mu == pytest.approx(refusal.estimated_mu)


def test_a_request_at_one_and_a_half_times_the_guarantees_remainder_is_billed_in_two_parts(
    sellable, served_model, acme, gateway, card, make_key, key_client
):
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=6,
        starts_at=timezone.now() - timedelta(days=1),
        status="active",
    )
    # 6 MU/min with a 10 s burst: 1 MU of guarantee left, plenty of best-effort.
    limits(acme, served_model, 6.0, 600.0)
    _, plaintext = make_key(customer=acme, scopes=[S.ADMISSION])
    # 650 prompt and 10 output tokens: (0.65 + 0.2 + 0.05) replica-s × 100/60 = 1.5 MU.
    shape = {"input_tokens": 650, "max_tokens": 10}
    answer = key_client(plaintext).post(
        "/api/v1/admission", {"model": "llama-8b", **shape, "request_id": "big"}, format="json"
    )
    assert answer.status_code == 200, answer.json()
    body = answer.json()
    assert body["estimated_mu"] == pytest.approx(1.5)
    # What is left of the guarantee, and only the rest beyond it.
    assert body["guaranteed_mu"] == pytest.approx(1.0)
    assert body["best_effort_mu"] == pytest.approx(0.5)
    assert body["class"] == "best_effort"

    stored_answer = post(gateway, event("big", input_tokens=650, output_tokens=10))
    assert stored_answer.status_code == 200, stored_answer.json()
    stored = UsageEvent.objects.get(event_id="big")
    assert stored.mu == pytest.approx(1.5)
    assert stored.guaranteed_mu == pytest.approx(1.0)
    assert stored.best_effort_mu == pytest.approx(0.5)
    assert stored.guaranteed_mu + stored.best_effort_mu == pytest.approx(stored.mu)

    invoice = invoice_now(acme)
    minute = UsageMinute.objects.get(customer=acme)
    assert (minute.guaranteed_mu, minute.best_effort_mu) == pytest.approx((1.0, 0.5))
    # The guaranteed part is within the commitment; the best-effort part is metered at its rate.
    assert invoice.lines.filter(kind="commitment").exists()
    (line,) = invoice.lines.filter(kind="best_effort")
    assert line.evidence["mu"] == pytest.approx(0.5)
    assert line.unit_price == Decimal("2.00")
    assert line.quantity == Decimal("0.0005")

"""What a gateway decided while Redis was down is billed as decided (issue 33, item 3): its
usage event carries `fallback_class` (no admission record exists), which ingestion takes from a
platform key only, and as guaranteed only for a customer that held a reservation then.
Before, such events were all best-effort `unrecorded`: a reserved customer paid best-effort
rates for traffic its reservation covered."""

from datetime import timedelta

import pytest
from django.utils import timezone

from accounts import scopes as S
from capacity.models import Reservation, UsageEvent
from tests.support.usage import gateway_client

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]
URL = "/api/v1/usage/events"


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
    return gateway_client(make_key, key_client, scopes=[S.USAGE_WRITE])


@pytest.fixture
def reserved(acme, served_model):
    return Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=60,
        starts_at=timezone.now() - timedelta(hours=1),
        status="active",
    )


def stored(event_id, customer="acme"):
    return UsageEvent.objects.get(event_id=event_id, customer__slug=customer)


def test_a_gateways_fallback_admission_is_billed_as_the_guaranteed_request_it_was(
    sellable, served_model, acme, gateway, reserved
):
    response = gateway.post(
        URL,
        {
            "events": [
                event("fb-1", fallback_class="guaranteed", api_key="mukey0123456"),
                event(
                    "fb-2",
                    outcome="refused",
                    output_tokens=0,
                    estimated_mu=0.7,
                    fallback_class="refused_guaranteed",
                ),
            ]
        },
        format="json",
    )
    assert response.status_code == 200, response.json()
    admitted = stored("fb-1")
    assert (admitted.admission_class, admitted.verification) == ("guaranteed", "fallback")
    # The key the gateway admitted it under: what that key's budget spends.
    assert admitted.api_key_prefix == "mukey0123456"
    assert admitted.guaranteed_mu == pytest.approx(admitted.mu) and admitted.best_effort_mu == 0
    refused = stored("fb-2")
    # A refusal of the reservation holder: guaranteed demand (what earns a refusal credit).
    assert (refused.outcome, refused.admission_class, refused.verification) == (
        "refused",
        "guaranteed",
        "fallback",
    )
    assert refused.estimated_mu == pytest.approx(0.7)


def test_a_fallback_claiming_a_guarantee_for_a_customer_without_a_reservation_is_best_effort(
    sellable, served_model, globex, gateway
):
    response = gateway.post(
        URL, {"events": [event("fb-3", customer="globex", fallback_class="guaranteed")]},
        format="json",
    )  # fmt: skip
    assert response.status_code == 200
    claimed = stored("fb-3", "globex")
    assert (claimed.admission_class, claimed.verification) == ("best_effort", "contradicted")
    assert claimed.best_effort_mu == pytest.approx(claimed.mu)


def test_a_customer_reporting_its_own_usage_never_picks_its_class_through_the_fallback(
    sellable, served_model, acme, reserved, make_key, key_client
):
    acme.may_report_own_usage = True
    acme.save()
    _, plaintext = make_key(customer=acme, scopes=[S.USAGE_WRITE])
    response = key_client(plaintext).post(
        URL, {"events": [event("fb-4", fallback_class="guaranteed")]}, format="json"
    )
    assert response.status_code == 200, response.json()
    claimed = stored("fb-4")
    assert (claimed.admission_class, claimed.verification) == ("best_effort", "unrecorded")


def test_a_bad_fallback_class_is_refused_naming_the_field(sellable, served_model, acme, gateway):
    response = gateway.post(
        URL, {"events": [event("fb-5", fallback_class="all_of_it")]}, format="json"
    )
    assert response.status_code == 400
    reasons = response.json()["rejected"][0]["reasons"]
    assert any(reason.startswith("fallback_class:") for reason in reasons), reasons

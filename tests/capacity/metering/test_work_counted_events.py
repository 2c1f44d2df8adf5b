"""Usage counted as the engine did the work (issue 34, findings 3 and 13): a request of several
prompts (or `n` sequences) is held to the context per prompt and priced as that many engine
requests, so its usage is recorded rather than rejected (and served free); a request the engine
refused before any work is recorded at 0 MU when the platform's gateway says so."""

from datetime import timedelta

import pytest
from django.utils import timezone

from accounts import scopes as S
from capacity.models import UsageEvent
from capacity.pricing.features import mu_of, replica_seconds_of, replica_seconds_of_batch
from tests.support.usage import gateway_client

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]
URL = "/api/v1/usage/events"


def event(event_id, **overrides) -> dict:
    finished = timezone.now() - timedelta(seconds=5)
    return {
        "event_id": event_id,
        "customer": "acme",
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


def test_twelve_thousand_prompt_tokens_of_four_prompts_are_recorded_and_priced_as_four_requests(
    sellable, served_model, acme, gateway
):
    # The model's context is 8,192 tokens: 12,000 prompt tokens fit as four prompts of 3,000.
    batched = event("batched", input_tokens=12_000, output_tokens=8 * 64, prompts=4, sequences=8)
    whole = event("whole", input_tokens=12_000, output_tokens=8 * 64)  # one prompt: too long
    response = gateway.post(URL, {"events": [batched, whole]}, format="json")
    assert response.status_code == 207, response.json()
    assert response.json()["accepted"] == ["batched"]
    (rejected,) = response.json()["rejected"]
    assert rejected["event_id"] == "whole" and "input_tokens" in rejected["reasons"][0]
    stored = UsageEvent.objects.get(event_id="batched")
    expected = mu_of(
        replica_seconds_of_batch(
            sellable.weights_replica_seconds,
            prompts=4, sequences=8, input_tokens=12_000, output_tokens=512,
        ),
        sellable.replica_mu_per_minute,
    )  # fmt: skip
    assert stored.mu == pytest.approx(expected)
    assert (stored.prompts, stored.sequences) == (4, 8)
    # More than one request of the shape would cost: each prompt's overhead, each sequence's.
    one_request = mu_of(
        replica_seconds_of(sellable.weights_replica_seconds, input_tokens=12_000,
                           output_tokens=512),
        sellable.replica_mu_per_minute,
    )  # fmt: skip
    assert stored.mu > one_request


def test_sequences_fewer_than_prompts_are_refused_naming_the_fields(
    sellable, served_model, acme, gateway
):
    response = gateway.post(URL, {"events": [event("odd", prompts=3, sequences=2)]}, format="json")
    assert response.status_code == 400
    assert "sequences must be at least prompts" in str(response.json())


def test_a_request_the_engine_refused_is_billed_nothing_on_the_gateways_word_only(
    sellable, served_model, acme, gateway, make_key, key_client
):
    refused = event("engine-400", outcome="error", output_tokens=0, engine_status=400)
    assert gateway.post(URL, {"events": [refused]}, format="json").status_code == 200
    stored = UsageEvent.objects.get(event_id="engine-400")
    assert (stored.mu, stored.best_effort_mu, stored.guaranteed_mu) == (0.0, 0.0, 0.0)
    # A customer reporting its own usage cannot make its requests free by saying so.
    acme.may_report_own_usage = True
    acme.save()
    _, own = make_key(customer=acme, scopes=[S.USAGE_WRITE])
    claimed = event("own-400", outcome="error", output_tokens=0, engine_status=400)
    assert key_client(own).post(URL, {"events": [claimed]}, format="json").status_code == 200
    assert UsageEvent.objects.get(event_id="own-400").mu > 0
    # The status of an engine's refusal, on an event that ran, is refused by name.
    ran = event("ran-400", engine_status=400)
    answer = gateway.post(URL, {"events": [ran]}, format="json")
    assert answer.status_code == 400 and "engine_status" in str(answer.json())

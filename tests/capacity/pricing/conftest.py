"""Last week's traffic for price reviews: usage posted through the real ingestion path."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.conftest import SIMPLE_WEIGHTS, make_cost_model

USAGE = "/api/v1/usage/events"
COST_MODELS = "/api/v1/cost-models/"


def scaled(factor: float, **per_feature: float) -> dict:
    """SIMPLE_WEIGHTS × factor, with some features scaled again by their own factor."""
    return {
        name: weight * factor * per_feature.get(name, 1.0)
        for name, weight in SIMPLE_WEIGHTS.items()
    }


def replica_seconds(weights: dict, input_tokens: int, output_tokens: int) -> float:
    """The plain α/β/γ weights by hand: what the currency's code must agree with."""
    return (
        weights["input_tokens"] * input_tokens
        + weights["output_tokens"] * output_tokens
        + weights["request"]
    )


@pytest.fixture
def gateway(make_key, key_client):
    _, plaintext = make_key(service_name="gateway", scopes=["read", "usage:write"])
    return key_client(plaintext)


def post_usage(client, customer: str, *, count: int, input_tokens: int, output_tokens: int):
    finished = timezone.now() - timedelta(minutes=2)
    events = [
        {
            "event_id": uuid.uuid4().hex,
            "customer": customer,
            "model": "llama-8b",
            "started_at": (finished - timedelta(seconds=2)).isoformat(),
            "finished_at": finished.isoformat(),
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "outcome": "completed",
        }
        for _ in range(count)
    ]
    response = client.post(USAGE, {"events": events}, format="json")
    assert response.status_code == 200, response.json()
    return [event["event_id"] for event in events]


@pytest.fixture
def last_week(gateway, acme, globex, served_model, gpu_type):
    """v1 active; acme sent long answers (1000 in / 100 out), globex long prompts (4000 / 20)."""
    v1 = make_cost_model(served_model, gpu_type)
    assert v1.status == "active"
    post_usage(gateway, "acme", count=10, input_tokens=1000, output_tokens=100)
    post_usage(gateway, "globex", count=10, input_tokens=4000, output_tokens=20)
    # A refused request cost nothing, so it is no part of what a new version would reprice.
    finished = timezone.now() - timedelta(minutes=1)
    refused = {
        "event_id": "refused-1",
        "customer": "acme",
        "model": "llama-8b",
        "started_at": finished.isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": 2000,
        "output_tokens": 0,
        "outcome": "refused",
    }
    assert gateway.post(USAGE, {"events": [refused]}, format="json").status_code == 200
    return v1

"""Usage for tests that need traffic behind a price: events posted through the real ingestion
path (POST /api/v1/usage/events) by a platform key, as a gateway posts them."""

import uuid
from datetime import timedelta

from django.utils import timezone

from tests.conftest import SIMPLE_WEIGHTS, make_cost_model

USAGE = "/api/v1/usage/events"


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


def gateway_client(make_key, key_client):
    """A platform key that reports usage for any customer."""
    _, plaintext = make_key(service_name="gateway", scopes=["read", "usage:write"])
    return key_client(plaintext)


def post_usage(
    client,
    customer: str,
    *,
    count: int,
    input_tokens: int,
    output_tokens: int,
    outcome: str = "completed",
    model: str = "llama-8b",
) -> list[str]:
    """`count` requests of one shape that finished two minutes ago; their event ids."""
    finished = timezone.now() - timedelta(minutes=2)
    events = [
        {
            "event_id": uuid.uuid4().hex,
            "customer": customer,
            "model": model,
            "started_at": (finished - timedelta(seconds=2)).isoformat(),
            "finished_at": finished.isoformat(),
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "outcome": outcome,
        }
        for _ in range(count)
    ]
    response = client.post(USAGE, {"events": events}, format="json")
    assert response.status_code == 200, response.json()
    return [event["event_id"] for event in events]


def last_week_of_traffic(gateway, served_model, gpu_type):
    """v1 (SIMPLE_WEIGHTS) active, then acme's long answers (10 × 1000 in / 100 out), globex's
    long prompts (10 × 4000 / 20) and one refused request of acme's; returns v1."""
    v1 = make_cost_model(served_model, gpu_type)
    assert v1.status == "active"
    post_usage(gateway, "acme", count=10, input_tokens=1000, output_tokens=100)
    post_usage(gateway, "globex", count=10, input_tokens=4000, output_tokens=20)
    # A refused request cost nothing, so it is no part of what a new version would reprice.
    post_usage(gateway, "acme", count=1, input_tokens=2000, output_tokens=0, outcome="refused")
    return v1

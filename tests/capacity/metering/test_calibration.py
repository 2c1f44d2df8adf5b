"""A model's bytes per token, calibrated from the usage gateways report (prompt bytes beside
the engine's own input tokens) and published for the gateways' estimates before admission."""

import json
import uuid
from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from capacity.metering import calibration
from capacity.metering.rollups import direct_aggregation, usage_rollup
from capacity.models import UsageMinute
from capacity.publication.publish import publish_gateway_state

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
URL = "/api/v1/usage/events"


@pytest.fixture
def gateway(make_key, key_client):
    _, plaintext = make_key(service_name="gateway", scopes=["read", "usage:write"])
    return key_client(plaintext)


def event(**overrides) -> dict:
    finished = timezone.now() - timedelta(minutes=2)
    return {
        "event_id": uuid.uuid4().hex,
        "customer": "acme",
        "model": "llama-8b",
        "started_at": (finished - timedelta(seconds=3)).isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": 1000,
        "output_tokens": 10,
        "outcome": "completed",
    } | overrides


def published_bytes_per_token(settings) -> float:
    calibration.forget()
    assert publish_gateway_state(reason="test") is not None
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    return json.loads(client.hget("gw:v1:models", "llama-8b"))["bytes_per_token"]


def test_a_model_publishes_the_median_ratio_of_its_requests_prompt_bytes_to_their_input_tokens(
    gateway, sellable, acme, settings
):
    settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS = 5_000
    events = [
        # 2.5 and 3.5 bytes a token: the ratio of the sums is (2500 + 7000) / 3000.
        event(input_tokens=1000, prompt_bytes=2500),
        event(input_tokens=2000, prompt_bytes=7000),
        # Without prompt bytes (a token-id prompt), and refused (estimated tokens): not counted.
        event(input_tokens=5000),
        event(input_tokens=5000, prompt_bytes=100, outcome="refused"),
    ]
    assert gateway.post(URL, {"events": events}, format="json").status_code == 200
    usage_rollup()

    (minute,) = UsageMinute.objects.all()
    assert (minute.prompt_bytes, minute.prompt_bytes_input_tokens) == (9500, 3000)
    (direct,) = direct_aggregation().values()  # the portable pass agrees with PostgreSQL's
    assert (direct["prompt_bytes"], direct["prompt_bytes_input_tokens"]) == (9500, 3000)
    # 3,000 counted tokens are fewer than the minimum: the default still holds.
    assert published_bytes_per_token(settings) == settings.PUBLICATION_BYTES_PER_TOKEN

    more = [event(input_tokens=1000, prompt_bytes=3200) for _ in range(3)]
    assert gateway.post(URL, {"events": more}, format="json").status_code == 200
    usage_rollup()

    # The requests' own ratios, each weighing its input tokens: 2.5 (1,000), 3.2 (3,000), 3.5
    # (2,000): half of the 6,000 is reached at 3.2.
    assert published_bytes_per_token(settings) == pytest.approx(3.2)


def test_no_one_request_and_no_one_customer_moves_the_calibration(
    gateway, sellable, acme, globex, settings
):
    """Issue 34, finding 5: one request with a 1.5 MB `text` took the published ratio from 4
    to 64 within 10 s, and every estimate, TPM limit and budget cap ran 16x low."""
    settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS = 1_000
    normal = [  # 4 bytes a token, ten requests of each customer
        event(customer=c, input_tokens=500, prompt_bytes=2000)
        for c in ("acme", "globex")
        for _ in range(10)
    ]
    assert gateway.post(URL, {"events": normal}, format="json").status_code == 200
    usage_rollup()
    assert published_bytes_per_token(settings) == pytest.approx(4.0)
    # One request of 1.5 MB of text for 1,500 tokens: one vote among twenty-one.
    huge = event(customer="globex", input_tokens=1500, prompt_bytes=1_500_000)
    assert gateway.post(URL, {"events": [huge]}, format="json").status_code == 200
    usage_rollup()
    assert published_bytes_per_token(settings) == pytest.approx(4.0)
    # globex sends forty such: it holds at most half of the vote, acme's half still holds it.
    flood = [event(customer="globex", input_tokens=1500, prompt_bytes=1_500_000)] * 40
    assert gateway.post(URL, {"events": [e | {"event_id": uuid.uuid4().hex} for e in flood]},
                        format="json").status_code == 200  # fmt: skip
    usage_rollup()
    assert published_bytes_per_token(settings) == pytest.approx(4.0)
    (shown,) = calibration.calibrations(now=timezone.now()).values()
    assert (shown.customers, shown.requests) == (2, 61)


def test_the_planners_fleet_page_says_what_the_calibration_rests_on(
    gateway, sellable, acme, settings, planner_client
):
    settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS = 1_000
    events = [event(input_tokens=500, prompt_bytes=1750) for _ in range(4)]
    assert gateway.post(URL, {"events": events}, format="json").status_code == 200
    usage_rollup()
    calibration.forget()
    page = planner_client.get("/planner/").content.decode()
    assert "3.50 bytes a token: the median of the last\n  4 requests" in page


def test_usage_older_than_the_window_no_longer_calibrates(gateway, sellable, acme, settings):
    settings.PUBLICATION_BYTES_PER_TOKEN_MIN_TOKENS = 1_000
    settings.PUBLICATION_BYTES_PER_TOKEN_WINDOW_HOURS = 1
    finished = timezone.now() - timedelta(hours=2)
    old = event(
        input_tokens=1000, prompt_bytes=8000, finished_at=finished.isoformat(),
        started_at=(finished - timedelta(seconds=1)).isoformat(),
    )  # fmt: skip
    assert gateway.post(URL, {"events": [old]}, format="json").status_code == 200
    usage_rollup()

    assert published_bytes_per_token(settings) == settings.PUBLICATION_BYTES_PER_TOKEN


def test_prompt_bytes_must_be_a_non_negative_integer(gateway, sellable, acme):
    answer = gateway.post(URL, {"events": [event(prompt_bytes=-1), event(prompt_bytes="9")]},
                          format="json")  # fmt: skip

    assert answer.status_code == 400
    assert [r["reasons"][0].split(":")[0] for r in answer.json()["rejected"]] == [
        "prompt_bytes",
        "prompt_bytes",
    ]

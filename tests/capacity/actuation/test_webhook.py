"""The webhook actuator against a real receiver that checks signatures, and the emulator."""

import json
import re
import time

import httpx
import pytest

from capacity.actuation.webhook import WebhookActuator, request_body, sign, signed_headers
from dataplane.emulator import parse_config
from dataplane.emulator.background import BackgroundEmulator
from tests.capacity.actuation.conftest import apply, scale_request
from tests.support.recording_server import RecordingServer
from tests.support.secret_bindings import bind_secret
from tests.support.webhook_receiver import HANG, WebhookReceiver

SECRET = "correct horse battery staple"
SECRET_ENV = "MU_ACTUATOR_SCALE_WEBHOOK_SECRET"


@pytest.fixture
def receiver(settings):
    server = WebhookReceiver(secret=SECRET).start()
    bind_secret(settings, SECRET_ENV, "webhook", server.url)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_SCALE_WEBHOOK_SECRET", SECRET)


def config(url: str, **overrides) -> dict:
    return {
        "url": url,
        "secret_env": "MU_ACTUATOR_SCALE_WEBHOOK_SECRET",
        "timeout_seconds": 0.3,
    } | overrides


def test_it_posts_the_decision_signed_and_the_receiver_accepts_it(receiver):
    result = apply(WebhookActuator(), scale_request(config(receiver.url), target_replicas=4))

    assert result.ok, result.error
    assert (result.attempts, result.applied_replicas, result.observed_replicas) == (1, 4, 2)
    [received] = receiver.received
    assert received.status == 200
    assert json.loads(received.raw_body) == {
        "deployment": "llama-8b-h100",
        "model": "llama-8b",
        "target_replicas": 4,
        "current_replicas": 1,
        "decision_id": 42,
        "reasons": [{"code": "demand", "mu_per_minute": 250.0}],
    }
    assert received.headers["content-type"] == "application/json"
    assert abs(int(received.headers["x-timestamp"]) - time.time()) < 5
    assert re.fullmatch(r"[0-9a-f]{32}", received.headers["x-webhook-id"])
    assert received.headers["x-signature-256"].startswith("sha256=")


def test_every_request_carries_its_own_webhook_id(receiver):
    apply(WebhookActuator(), scale_request(config(receiver.url), target_replicas=4))
    apply(WebhookActuator(), scale_request(config(receiver.url), target_replicas=4))

    first, second = receiver.received
    assert (first.status, second.status) == (200, 200)
    assert first.headers["x-webhook-id"] != second.headers["x-webhook-id"]


def test_the_receiver_refuses_a_replayed_or_tampered_request(receiver):
    apply(WebhookActuator(), scale_request(config(receiver.url), target_replicas=4))
    [sent] = receiver.received
    headers = {
        "Content-Type": "application/json",
        "X-Timestamp": sent.headers["x-timestamp"],
        "X-Webhook-Id": sent.headers["x-webhook-id"],
        "X-Signature-256": sent.headers["x-signature-256"],
    }
    tampered = sent.raw_body.replace(b'"target_replicas":4', b'"target_replicas":40')
    other_id = headers | {"X-Webhook-Id": "0" * 32}

    replayed = httpx.post(receiver.url, content=sent.raw_body, headers=headers, trust_env=False)
    forged = httpx.post(receiver.url, content=tampered, headers=headers, trust_env=False)
    relabelled = httpx.post(receiver.url, content=sent.raw_body, headers=other_id, trust_env=False)

    # The same bytes within the window verify, but their id was used: a replay.
    assert (replayed.status_code, replayed.text) == (401, "replayed webhook id")
    assert forged.status_code == 401
    # The id is signed: a fresh one on the old signature does not verify.
    assert (relabelled.status_code, relabelled.text) == (401, "bad signature")


def test_a_wrong_secret_is_a_permanent_401(receiver, monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_SCALE_WEBHOOK_SECRET", "not the receiver's secret")

    result = apply(WebhookActuator(), scale_request(config(receiver.url)))

    assert (result.ok, result.attempts) == (False, 1)
    assert result.error.startswith(f"permanent: {receiver.url} answered 401")
    assert len(receiver.received) == 1


def test_an_unavailable_receiver_is_retried(receiver):
    receiver.fail_next(503)

    result = apply(WebhookActuator(), scale_request(config(receiver.url)))

    assert result.ok, result.error
    assert result.attempts == 2
    assert [r.status for r in receiver.received] == [503, 200]


def test_a_receiver_that_stays_unavailable_fails_after_the_last_attempt(receiver):
    receiver.fail_next(503, 503, 503)

    result = apply(WebhookActuator(), scale_request(config(receiver.url)), max_attempts=3)

    assert (result.ok, result.attempts) == (False, 3)
    assert result.error.startswith(f"transient: {receiver.url} answered 503")


def test_a_client_error_other_than_a_conflict_is_not_retried(receiver):
    receiver.fail_next(422)

    result = apply(WebhookActuator(), scale_request(config(receiver.url)))

    assert (result.ok, result.attempts) == (False, 1)
    assert "answered 422" in result.error


def test_a_receiver_that_does_not_answer_times_out_as_a_transient_failure(receiver):
    receiver.fail_next(HANG)

    result = apply(WebhookActuator(), scale_request(config(receiver.url)))

    assert result.ok, result.error
    assert result.attempts == 2
    assert [r.status for r in receiver.received] == [0, 200]


def test_an_unset_secret_variable_fails_before_sending_anything(receiver, monkeypatch):
    monkeypatch.delenv("MU_ACTUATOR_SCALE_WEBHOOK_SECRET")

    result = apply(WebhookActuator(), scale_request(config(receiver.url)))

    assert (result.ok, result.attempts) == (False, 1)
    assert "MU_ACTUATOR_SCALE_WEBHOOK_SECRET (secret_env) is not set" in result.error
    assert receiver.received == []


def test_a_secret_bound_to_another_receiver_is_refused_before_sending_anything(settings):
    # Bound when the config was written; the operator has bound the secret elsewhere since.
    with RecordingServer() as stale, RecordingServer() as bound_now:
        bind_secret(settings, SECRET_ENV, "webhook", bound_now.url)

        result = apply(WebhookActuator(), scale_request(config(f"{stale.url}/scale")))

    assert (result.ok, result.attempts) == (False, 1)
    assert result.error.startswith(f"permanent: actuator_config.secret_env: {SECRET_ENV} may be")
    assert f"not to {stale.url}" in result.error
    assert stale.requests == [] and bound_now.requests == []


def test_a_stored_config_without_secret_env_is_refused_before_sending_anything():
    receiver = WebhookReceiver(secret=None).start()
    try:
        result = apply(WebhookActuator(), scale_request({"url": receiver.url}))
    finally:
        receiver.stop()

    assert (result.ok, result.attempts) == (False, 1)
    assert "ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS" in result.error
    assert receiver.received == []


def test_when_the_operator_allows_unsigned_webhooks_it_sends_unsigned_requests(settings):
    settings.ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS = True
    receiver = WebhookReceiver(secret=None).start()
    try:
        result = apply(WebhookActuator(), scale_request({"url": receiver.url}))
    finally:
        receiver.stop()

    assert result.ok, result.error
    assert "x-signature-256" not in receiver.received[0].headers
    assert "x-webhook-id" not in receiver.received[0].headers


# -- the engine emulator's webhook endpoint ---------------------------------------------------


@pytest.fixture
def emulator(monkeypatch, settings):
    monkeypatch.setenv("EMULATOR_WEBHOOK_SECRET", SECRET)
    config = parse_config({"models": [{"name": "llama-8b", "replicas": 1}]})
    with BackgroundEmulator(config) as running:
        bind_secret(settings, SECRET_ENV, "webhook", running.url)
        yield running


def _emulated_replicas(emulator) -> dict:
    models = httpx.get(f"{emulator.url}/admin/replicas", trust_env=False).json()["models"]
    return next(m for m in models if m["model"] == "llama-8b")


def test_the_webhook_actuator_scales_the_emulator(emulator):
    url = f"{emulator.url}/admin/webhook/scale"

    result = apply(WebhookActuator(), scale_request(config(url), target_replicas=3))

    assert result.ok, result.error
    # The emulator reports its ready + starting replicas, as status.replicas counts pods.
    assert result.observed_replicas == 3
    assert _emulated_replicas(emulator)["target"] == 3


def test_the_emulator_refuses_a_wrong_secret(emulator, monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_SCALE_WEBHOOK_SECRET", "not the emulator's secret")
    url = f"{emulator.url}/admin/webhook/scale"

    result = apply(WebhookActuator(), scale_request(config(url), target_replicas=3))

    assert (result.ok, result.attempts) == (False, 1)
    assert "answered 401" in result.error
    assert _emulated_replicas(emulator)["target"] == 1


def test_the_emulator_refuses_unsigned_and_stale_requests(emulator):
    url = f"{emulator.url}/admin/webhook/scale"
    body = request_body(scale_request({}, target_replicas=3))
    stale = str(int(time.time()) - 301)

    stale_id = "1" * 32

    unsigned = httpx.post(url, content=body, trust_env=False)
    replayed_late = httpx.post(
        url,
        content=body,
        headers={
            "X-Timestamp": stale,
            "X-Webhook-Id": stale_id,
            "X-Signature-256": sign(SECRET, stale, stale_id, body),
        },
        trust_env=False,
    )

    assert unsigned.status_code == 401
    assert replayed_late.status_code == 401
    assert "300 s" in replayed_late.json()["error"]["message"]
    assert _emulated_replicas(emulator)["target"] == 1


def test_the_emulator_refuses_a_replayed_webhook_id_within_its_window(emulator):
    url = f"{emulator.url}/admin/webhook/scale"
    body = request_body(scale_request({}, target_replicas=3))
    headers = signed_headers(SECRET, body)
    lower = request_body(scale_request({}, target_replicas=2))

    first = httpx.post(url, content=body, headers=headers, trust_env=False)
    assert first.status_code == 200
    httpx.post(url, content=lower, headers=signed_headers(SECRET, lower), trust_env=False)
    replayed = httpx.post(url, content=body, headers=headers, trust_env=False)

    assert replayed.status_code == 401
    assert "replay" in replayed.json()["error"]["message"]
    # The replay would have scaled back up to 3.
    assert _emulated_replicas(emulator)["target"] == 2


def test_the_emulator_answers_404_for_a_model_it_does_not_serve(emulator):
    url = f"{emulator.url}/admin/webhook/scale"

    result = apply(WebhookActuator(), scale_request(config(url), model="mistral-7b"))

    assert (result.ok, result.attempts) == (False, 1)
    assert "answered 404" in result.error

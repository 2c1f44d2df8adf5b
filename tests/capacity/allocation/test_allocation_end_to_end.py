"""End to end: an emulator fleet, usage flowing in through the API, ticks running — the
emulator's replicas follow demand up, then down to zero once the model is idle."""

from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from capacity.allocation.tick import allocation_tick
from capacity.metering.rollups import usage_rollup
from capacity.models import AllocationDecision, Deployment
from dataplane.emulator.background import BackgroundEmulator
from dataplane.emulator.config import parse_config
from tests.support.factories import DeploymentFactory
from tests.support.secret_bindings import bind_secret

pytestmark = pytest.mark.django_db

EMULATOR = {
    "seed": 1,
    "models": [
        {
            "name": "llama-8b",
            "replicas": 1,
            "cold_start_seconds": 0,
            "max_num_seqs": 8,
            "decode_step_base_seconds": 0.001,
        }
    ],
}


def emulator_replicas(url: str) -> dict:
    models = httpx.get(f"{url}/admin/replicas", timeout=5, trust_env=False).json()["models"]
    return next(m for m in models if m["model"] == "llama-8b")


def post_usage(client, *, mu_per_minute_wanted: float, minutes: int, now):
    # With the fixture's cost model an event of 1000 in / 100 out costs 3.05 × 100 / 60 MU.
    per_event_mu = 3.05 * 100 / 60
    per_minute = round(mu_per_minute_wanted / per_event_mu)
    events = []
    for minute in range(1, minutes + 1):
        for n in range(per_minute):
            finished = now - timedelta(minutes=minute) + timedelta(seconds=n * 60 / per_minute)
            events.append(
                {
                    "event_id": f"e2e-{minute}-{n}",
                    "customer": "acme",
                    "model": "llama-8b",
                    "started_at": (finished - timedelta(seconds=2)).isoformat(),
                    "finished_at": finished.isoformat(),
                    "input_tokens": 1000,
                    "output_tokens": 100,
                    "outcome": "completed",
                    "admission_class": "best_effort",
                }
            )
    response = client.post("/api/v1/usage/events", {"events": events}, format="json")
    assert response.status_code == 200, response.json()


def test_replicas_follow_demand_up_and_down(
    sellable, served_model, pool, acme, make_key, key_client, monkeypatch, settings
):
    # Signed, as in the demo: the emulator checks what the control plane signs.
    monkeypatch.setenv("EMULATOR_WEBHOOK_SECRET", "end-to-end-secret")
    monkeypatch.setenv("MU_ACTUATOR_EMULATOR_SECRET", "end-to-end-secret")
    _, plaintext = make_key(service_name="gateway", scopes=["read", "usage:write"])
    client = key_client(plaintext)
    served_model.engine_model_id = "llama-8b"  # the name the emulator serves it under
    served_model.save()
    with BackgroundEmulator(parse_config(EMULATOR)) as emulator:
        bind_secret(settings, "MU_ACTUATOR_EMULATOR_SECRET", "webhook", emulator.url)
        Deployment.objects.filter(name="llama-8b-h100").delete()
        deployment = DeploymentFactory(
            name="llama-emu",
            served_model=served_model,
            gpu_pool=pool,
            min_replicas=0,
            max_replicas=6,
            current_replicas=1,
            target_utilisation=1.0,
            scale_to_zero_after_seconds=600,
            endpoint_url=emulator.url,
            actuator_kind="webhook",
            actuator_config={
                "url": f"{emulator.url}/admin/webhook/scale",
                "secret_env": "MU_ACTUATOR_EMULATOR_SECRET",
            },
        )
        now = timezone.now().replace(second=0, microsecond=0)
        post_usage(client, mu_per_minute_wanted=390, minutes=5, now=now)
        usage_rollup()

        up = allocation_tick(now=now + timedelta(seconds=5))
        assert up.applied == 1, AllocationDecision.objects.first().actuator_error
        deployment.refresh_from_db()
        assert deployment.current_replicas == 4
        assert emulator_replicas(emulator.url)["target"] == 4

        # Twenty minutes without traffic: the first tick holds (no recent recommendation to
        # justify a scale-down), the next one releases the replicas and scales to zero.
        later = now + timedelta(minutes=20)
        allocation_tick(now=later)
        deployment.refresh_from_db()
        assert deployment.current_replicas == 4
        allocation_tick(now=later + timedelta(seconds=15))
        deployment.refresh_from_db()
        assert deployment.current_replicas == 0
        assert emulator_replicas(emulator.url)["target"] == 0
        reasons = {r["code"] for r in AllocationDecision.objects.first().reasons}
        assert "scale_to_zero" in reasons

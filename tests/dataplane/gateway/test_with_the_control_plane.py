"""The gateway in front of the real control plane: the contract comes from the control plane's
own publisher (after a real probe round and allocation tick) and usage goes to the real API
(gunicorn on the test database). The whole mix of outcomes across an API outage, with Celery
driving the ticks, is in test_acceptance.py."""

import threading

import httpx
import pytest
from django.conf import settings

from accounts import scopes as S
from capacity.admission.gate import buckets
from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_round
from capacity.models import ActuatorKind, Deployment, Replica
from capacity.publication.publish import publish_gateway_state
from capacity.selling.entitlements import entitlements_set
from capacity.selling.reservations import reservation_create
from tests.support.admission import set_rates
from tests.support.processes import free_port

from .conftest import gateway_process, tiny_model
from .control_plane import complete, control_plane

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgresql_only,
    pytest.mark.slow,
]


@pytest.fixture
def fleet(sellable, served_model, acme, globex, make_key, tmp_path, start_emulator):
    """llama-8b served by one emulator replica that the probes found healthy; acme holds a
    reservation, globex none; both may use the model; the gateway's service key."""
    emulator_url, _ = start_emulator(
        {"seed": 0, "models": [tiny_model(name=served_model.engine_model_id)]}
    )
    Deployment.objects.filter(served_model=served_model).update(
        actuator_kind=ActuatorKind.DRY_RUN, endpoint_url=emulator_url, current_replicas=1
    )
    for customer in (acme, globex):
        entitlements_set(customer=customer, served_models=[served_model], actor="test")
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=300, actor="test")
    probe_round()  # the real probes: the replica answers and becomes ready
    assert Replica.objects.filter(state=Replica.State.HEALTHY).count() == 1
    allocation_tick()  # admission limits and the gateway contract, as every 15 s
    # No best-effort capacity for anyone: globex, without a reservation, is always refused.
    set_rates(
        buckets(),
        {(acme.pk, served_model.pk): (300.0, 0.0), (globex.pk, served_model.pk): (0.0, 0.0)},
        ttl_s=settings.ADMISSION_LIMITS_TTL_SECONDS,
    )
    assert publish_gateway_state(reason="test") is not None
    _, acme_key = make_key(customer=acme, scopes=[S.READ, S.ADMISSION])
    _, globex_key = make_key(customer=globex, scopes=[S.READ, S.ADMISSION])
    _, service_key = make_key(service_name="gateway", scopes=[S.USAGE_WRITE])
    return {"acme": acme_key, "globex": globex_key, "service": service_key,
            "model": served_model.name, "emulator": emulator_url}  # fmt: skip


def test_a_guaranteed_customer_within_its_reservation_is_never_refused_while_best_effort_floods(
    fleet, acme, globex, served_model, tmp_path
):
    # globex lives off the fleet's slack (best-effort only); acme holds 300 MU/min.
    set_rates(
        buckets(),
        {(acme.pk, served_model.pk): (300.0, 0.0), (globex.pk, served_model.pk): (0.0, 30.0)},
        ttl_s=settings.ADMISSION_LIMITS_TTL_SECONDS,
    )
    port = free_port()
    outcomes: dict[str, list[int]] = {"acme": [], "globex": []}

    def flood(who: str, count: int) -> None:
        with httpx.Client(timeout=30, trust_env=False) as client:
            for _ in range(count):
                _, status, _ = complete(
                    client, gateway.url, fleet[who], fleet["model"], stream=False, max_tokens=20
                )
                outcomes[who].append(status)

    with control_plane(tmp_path, port) as api_url, gateway_process(
        tmp_path,
        GATEWAY_CONTROL_PLANE_URL=api_url,
        GATEWAY_SERVICE_KEY=fleet["service"],
        GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
        GATEWAY_WORKERS="2",
    ) as gateway:  # fmt: skip
        # Best-effort floods from four clients at once while acme sends well within its rate
        # (20 requests of about 0.6 MU against 300 MU/min and a 50 MU burst).
        floods = [threading.Thread(target=flood, args=("globex", 25)) for _ in range(4)]
        for thread in floods:
            thread.start()
        flood("acme", 20)
        for thread in floods:
            thread.join()

    assert outcomes["acme"] == [200] * 20
    assert 429 in outcomes["globex"] and 200 in outcomes["globex"]


def test_no_one_rewrites_the_gateways_admission_record_of_a_request_through_the_api(
    fleet, acme, globex, make_key, key_client, tmp_path
):
    """Issue 34, finding 4: a second POST /api/v1/admission with the gateway's X-Request-Id
    (answered to the client) overwrote its record and erased its settled mark: a stream
    admitted best-effort was billed guaranteed. A record is written once now."""
    set_rates(
        buckets(),
        {(acme.pk, served_model_id(fleet)): (0.0, 600.0)},  # acme best-effort only
        ttl_s=settings.ADMISSION_LIMITS_TTL_SECONDS,
    )
    with gateway_process(
        tmp_path,
        GATEWAY_SERVICE_KEY=fleet["service"],
        GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
    ) as gateway, httpx.Client(timeout=30, trust_env=False) as client:  # fmt: skip
        request_id, status, _ = complete(
            client, gateway.url, fleet["acme"], fleet["model"], stream=True, max_tokens=4
        )
    assert status == 200
    record_key = f"adm:req:{served_model_id(fleet)}:{acme.pk}:{request_id}"
    recorded = buckets().client.get(record_key)
    assert recorded.startswith(b"best_effort:")
    body = {"model": fleet["model"], "input_tokens": 3, "max_tokens": 4, "request_id": request_id}
    # The customer's own key: the gateway's ids are not its to name.
    own = key_client(fleet["acme"]).post("/api/v1/admission", body, format="json")
    assert own.status_code == 400
    assert "request_id" in own.json()["error"]["fields"]
    # A platform key may name any id, but not decide a recorded one again.
    _, platform = make_key(service_name="other-gateway", scopes=[S.ADMISSION])
    again = key_client(platform).post(
        "/api/v1/admission", body | {"customer": "acme"}, format="json"
    )
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "request_id_decided"
    assert buckets().client.get(record_key) == recorded


def served_model_id(fleet) -> int:
    return Deployment.objects.get(endpoint_url=fleet["emulator"]).served_model_id

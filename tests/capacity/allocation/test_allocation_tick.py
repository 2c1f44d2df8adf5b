"""The tick against the database: snapshot, decisions stored, targets applied, one at a time."""

import json
import threading
import time
from dataclasses import replace
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.management import call_command
from django.db import close_old_connections, connection
from django.utils import timezone

from capacity.admission.gate import buckets
from capacity.admission.gateways import WAITING
from capacity.admission.redis_layout import LIMITS_FRESH_KEY, floor_key, limits_key
from capacity.allocation.snapshot import build_snapshot, digest
from capacity.allocation.tick import allocation_tick
from capacity.models import (
    ActuatorCircuit,
    AdmissionAllowance,
    AllocationDecision,
    Deployment,
    Reservation,
    UsageEvent,
    UsageMinute,
)

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


@pytest.fixture
def fleet(sellable, served_model, acme, globex):
    """llama-8b: one dry-run deployment at 1 replica (100 MU/min each, up to 8)."""
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1, target_utilisation=1.0
    )
    return Deployment.objects.get(name="llama-8b-h100")


def use(customer, model, mu_per_minute: float, minutes: int = 5):
    now = timezone.now().replace(second=0, microsecond=0)
    UsageMinute.objects.bulk_create(
        UsageMinute(
            customer=customer,
            served_model=model,
            minute=now - timedelta(minutes=m),
            requests=10,
            mu=mu_per_minute,
        )
        for m in range(1, minutes + 1)
    )


def test_a_tick_follows_demand_and_stores_its_decision(fleet, served_model, acme, globex):
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=150,
        starts_at=timezone.now() - timedelta(hours=1),
        status="active",
    )
    use(globex, served_model, 230)

    result = allocation_tick()

    fleet.refresh_from_db()
    assert fleet.current_replicas == 4  # 150 reserved + 230 best-effort at 100 MU/min each
    decision = AllocationDecision.objects.get(deployment=fleet)
    assert (decision.current_replicas, decision.target_replicas) == (1, 4)
    assert decision.actuator_ok is True
    assert {reason["code"] for reason in decision.reasons} >= {"guaranteed", "best_effort"}
    assert len(decision.inputs_digest) == 64
    allowances = {a.customer.slug: a for a in AdmissionAllowance.objects.all()}
    assert allowances["acme"].guaranteed_mu_per_minute == 150
    assert allowances["globex"].guaranteed_mu_per_minute == 0
    assert result.applied == 1


def test_a_sub_minute_burst_is_planned_for_beyond_its_minute_average(
    fleet, served_model, globex, sellable
):
    # 500 MU of requests that all started within 5 seconds, a minute ago: the minute averages
    # 500 MU/min (5 replicas of 100), but starting them all within the 2 s TTFT SLO needs
    # 500 MU over 7 s = 4,286 MU/min, more than the deployment's 8 replicas hold.
    now = timezone.now()
    started = now - timedelta(seconds=60)
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=f"burst-{i}",
            customer=globex,
            served_model=served_model,
            started_at=started + timedelta(seconds=i % 5),
            finished_at=started + timedelta(seconds=10),
            minute=(started + timedelta(seconds=10)).replace(second=0, microsecond=0),
            input_tokens=2000,
            output_tokens=20,
            outcome="completed",
            admission_class="best_effort",
            mu=5.0,
            cost_model=sellable,
            ingested_at=now,
        )
        for i in range(100)
    )
    use(globex, served_model, 100, minutes=1)
    allocation_tick()
    fleet.refresh_from_db()
    assert fleet.current_replicas == 8
    decision = AllocationDecision.objects.get(deployment=fleet)
    assert "best_effort_limited" in {reason["code"] for reason in decision.reasons}
    # The same MU spread over the whole minute is no burst: planned at its minute's rate.
    UsageEvent.objects.all().delete()
    UsageMinute.objects.all().delete()
    AllocationDecision.objects.all().delete()
    Deployment.objects.filter(pk=fleet.pk).update(current_replicas=1)
    use_events(globex, served_model, sellable, mu_per_second=500 / 60, seconds=60)
    use(globex, served_model, 500, minutes=1)
    allocation_tick()
    fleet.refresh_from_db()
    assert fleet.current_replicas == 5


def use_events(customer, model, cost_model, *, mu_per_second: float, seconds: int):
    now = timezone.now()
    start = now - timedelta(seconds=seconds + 5)
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=f"steady-{i}",
            customer=customer,
            served_model=model,
            started_at=start + timedelta(seconds=i),
            finished_at=start + timedelta(seconds=i + 1),
            minute=(start + timedelta(seconds=i + 1)).replace(second=0, microsecond=0),
            input_tokens=100,
            output_tokens=10,
            outcome="completed",
            admission_class="best_effort",
            mu=mu_per_second,
            cost_model=cost_model,
            ingested_at=now,
        )
        for i in range(seconds)
    )


def test_a_drop_in_demand_waits_for_the_stabilisation_window(fleet, served_model, globex):
    use(globex, served_model, 600)
    allocation_tick()
    UsageMinute.objects.all().delete()
    use(globex, served_model, 100)
    allocation_tick()
    fleet.refresh_from_db()
    assert fleet.current_replicas == 6  # held by the recommendation of the previous tick
    # Once the high recommendation is out of the window, only the low one remains.
    AllocationDecision.objects.filter(recommended_replicas=6).update(
        created_at=timezone.now() - timedelta(minutes=10)
    )
    allocation_tick()
    fleet.refresh_from_db()
    assert fleet.current_replicas == 1


def test_dry_run_changes_nothing(fleet, served_model, globex, capsys):
    use(globex, served_model, 500)
    call_command("allocate", "--dry-run")
    out = capsys.readouterr().out
    assert "llama-8b-h100: would set 1 → 5" in out
    fleet.refresh_from_db()
    assert fleet.current_replicas == 1
    assert not AllocationDecision.objects.exists()


def test_allocate_json_is_machine_readable(fleet, served_model, globex, capsys):
    import json

    use(globex, served_model, 500)
    call_command("allocate", "--dry-run", "--json")
    payload = json.loads(capsys.readouterr().out)
    assert payload["decisions"][0]["target_replicas"] == 5


def test_failures_open_a_circuit_and_the_next_tick_decides_afresh(
    fleet, served_model, globex, monkeypatch, settings
):
    monkeypatch.setenv("MU_ACTUATOR_HOOK_SECRET", "hook-secret")
    settings.ACTUATOR_SECRET_DESTINATIONS = {
        "MU_ACTUATOR_HOOK_SECRET": {"webhook": ["127.0.0.1:9"]}
    }
    Deployment.objects.filter(pk=fleet.pk).update(
        actuator_kind="webhook",
        actuator_config={
            "url": "http://127.0.0.1:9/scale",
            "secret_env": "MU_ACTUATOR_HOOK_SECRET",
            "timeout_seconds": 0.2,
        },
    )
    use(globex, served_model, 300)
    for _ in range(3):
        allocation_tick()
    fleet.refresh_from_db()
    assert fleet.current_replicas == 1  # nothing was applied
    circuit = ActuatorCircuit.objects.get(deployment=fleet)
    assert circuit.consecutive_failures == 3
    assert circuit.opened_until > timezone.now()
    allocation_tick()
    latest = AllocationDecision.objects.filter(deployment=fleet).first()
    assert latest.actuator_ok is False
    assert "circuit open" in latest.actuator_error
    # Nothing listens on port 9: the failures were the data plane's, not the config's.
    assert "ConnectError" in ActuatorCircuit.objects.get(deployment=fleet).last_error
    assert ActuatorCircuit.objects.get(deployment=fleet).consecutive_failures == 3


def test_the_api_explains_decisions_to_planners_and_hides_them_from_customers(
    fleet, served_model, globex, planner_client, acme_key_client
):
    use(globex, served_model, 300)
    allocation_tick()
    decisions = planner_client.get("/api/v1/allocation/decisions/?deployment__name=llama-8b-h100")
    assert decisions.json()["results"][0]["target_replicas"] == 3
    why = planner_client.get("/api/v1/models/llama-8b/why").json()
    assert "from 1 to 3 replicas" in why["deployments"][0]["why"]
    assert "best-effort" in why["deployments"][0]["why"]
    assert acme_key_client.get("/api/v1/allocation/decisions/").status_code == 403
    assert acme_key_client.get("/api/v1/models/llama-8b/why").status_code == 403


def test_customers_see_only_their_own_allowances(
    fleet, served_model, acme, globex, acme_key_client, planner_client
):
    use(acme, served_model, 50)
    use(globex, served_model, 70)
    allocation_tick()
    mine = acme_key_client.get("/api/v1/allocation/allowances/").json()["results"]
    assert [row["customer"] for row in mine] == ["acme"]
    assert planner_client.get("/api/v1/allocation/allowances/").json()["count"] == 2


class _SlowScale(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802 - the http.server API
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(1.5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql_only
def test_two_concurrent_ticks_never_both_apply(sellable, served_model, globex, settings):
    settings.ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS = True  # the slow receiver checks nothing
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowScale)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1,
        target_utilisation=1.0,
        actuator_kind="webhook",
        actuator_config={"url": f"http://127.0.0.1:{server.server_address[1]}/scale"},
    )
    use(globex, served_model, 400)
    results = []
    barrier = threading.Barrier(2)

    def tick():
        barrier.wait()
        try:
            results.append(allocation_tick())
        finally:
            close_old_connections()

    threads = [threading.Thread(target=tick) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    server.shutdown()

    assert sorted(result.skipped for result in results) == [False, True]
    assert _SlowScale.calls == 1
    assert AllocationDecision.objects.count() == 1
    assert connection.vendor == "postgresql"


def test_prometheus_down_holds_the_fleet_instead_of_scaling_it_down(
    fleet, served_model, globex, settings
):
    Deployment.objects.filter(pk=fleet.pk).update(current_replicas=5)
    settings.PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens there
    allocation_tick()
    allocation_tick()
    fleet.refresh_from_db()
    assert fleet.current_replicas == 5
    codes = {r["code"] for r in AllocationDecision.objects.first().reasons}
    assert "load_unknown" in codes


def test_the_snapshot_carries_each_customers_tier_weight(fleet, served_model, acme, globex):
    from capacity.allocation.snapshot import build_snapshot
    from capacity.models import Entitlement

    acme.tier_id, globex.tier_id = "free", "enterprise"
    acme.save()
    globex.save()
    for customer in (acme, globex):
        Entitlement.objects.create(customer=customer, served_model=served_model)

    snapshot, _, _ = build_snapshot(now=timezone.now())

    (model,) = snapshot.models
    # The migrated tiers' weights (accounts.tiers.DEFAULT_TIERS), for the policy's split.
    assert {c.customer_id: c.tier_weight for c in model.customers} == {acme.pk: 1.0, globex.pk: 8.0}


def test_a_tick_writes_the_limits_that_changed_and_all_of_them_once_redis_lost_them(
    fleet, served_model, acme, globex
):
    reservation = Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=150,
        starts_at=timezone.now() - timedelta(hours=1),
        status="active",
    )
    use(globex, served_model, 230)
    allocation_tick()
    redis = buckets().client
    acme_floor = floor_key(acme.pk, served_model.pk)
    globex_key = limits_key(globex.pk, served_model.pk)
    # The reservation's floor (the tick's publication writes what is sold), globex's slack.
    assert float(redis.hget(acme_floor, "g")) == 150
    assert float(redis.hget(globex_key, "be")) > 0
    assert 0 < redis.ttl(LIMITS_FRESH_KEY) <= 60

    # A reservation changed by any path (here the ORM, as the admin does) reaches admission on
    # the next tick: the floors are written whole whenever they differ from the last.
    Reservation.objects.filter(pk=reservation.pk).update(mu_per_minute=250)
    allocation_tick()
    assert float(redis.hget(acme_floor, "g")) == 250

    # Redis lost everything (a restart without persistence): the next tick writes every
    # pair again, the ones that did not change included.
    redis.flushdb()
    allocation_tick()
    assert float(redis.hget(acme_floor, "g")) == 250
    assert float(redis.hget(globex_key, "be")) > 0
    assert redis.ttl(globex_key) > 60


def test_the_inputs_digest_follows_what_the_policy_read(fleet, served_model, acme, globex):
    use(acme, served_model, 50)
    use(globex, served_model, 70)
    now = timezone.now()
    model = build_snapshot(now=now)[0].models[0]
    assert digest(model) == digest(build_snapshot(now=now)[0].models[0])
    first, *rest = model.customers
    more_demand = replace(first, recent_mu_per_minute=first.recent_mu_per_minute + 1)
    assert digest(replace(model, customers=(more_demand, *rest))) != digest(model)
    assert digest(replace(model, customers=tuple(rest))) != digest(model)
    bigger = replace(model.deployments[0], max_replicas=model.deployments[0].max_replicas + 1)
    assert digest(replace(model, deployments=(bigger,))) != digest(model)


def test_requests_held_at_a_gateway_wake_a_model_at_zero_with_the_replicas_their_rate_needs(
    fleet, served_model
):
    """What a gateway writes in gw:v1:waiting (docs/gateway-contract.md) as the tick reads it:
    15 MU held, the oldest for 6 s, arrive at 150 MU/min; over a minute, at 15 MU/min."""
    Deployment.objects.filter(pk=fleet.pk).update(current_replicas=0)
    redis = buckets().client

    def tick_with_requests_held_for(seconds: float) -> int:
        now_s = time.time()
        entry = {"requests": 36, "mu": 15.0, "since": now_s - seconds, "updated_at": now_s}
        redis.hset(WAITING, served_model.name, json.dumps(entry))
        try:
            allocation_tick()
        finally:
            redis.hdel(WAITING, served_model.name)
        return AllocationDecision.objects.order_by("-created_at").first().target_replicas

    assert tick_with_requests_held_for(6) == 2  # 150 MU/min on 100 MU/min replicas
    Deployment.objects.filter(pk=fleet.pk).update(current_replicas=0)
    assert tick_with_requests_held_for(60) == 1

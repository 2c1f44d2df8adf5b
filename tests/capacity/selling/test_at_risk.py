"""Changing the fleet under sold reservations: refused, or forced into an oversold state that
is shown, measured on /metrics and alerted once."""

import json

import pytest
from django.utils import timezone

from capacity.models import CapacityRisk, CostModel
from capacity.selling.at_risk import fleet_recheck
from core.models import AuditEntry
from tests.conftest import make_cost_model
from tests.support.factories import DeploymentFactory, GpuPoolFactory, GpuTypeFactory
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
POOL = "/api/v1/gpu-pools/us-east-h100/"
SECRET = "alert-secret-for-tests"


@pytest.fixture
def receiver(settings):
    hook = WebhookReceiver(SECRET).start()
    settings.ALERT_WEBHOOK_URL = hook.url
    settings.ALERT_WEBHOOK_SECRET = SECRET
    yield hook
    hook.stop()


@pytest.fixture
def sold(planner_client, acme, globex, served_model, pool, gpu_type):
    """llama-8b on two deployments of 4 GPUs in the 8-GPU pool: 720 MU/min sellable, 600 sold
    (acme 400, globex 200)."""
    for name in ("llama-8b-a", "llama-8b-b"):
        DeploymentFactory(name=name, served_model=served_model, gpu_pool=pool, max_replicas=4)
    make_cost_model(served_model, gpu_type)
    served_model.headroom = 0.1
    served_model.save()
    ids = []
    for customer, mu in (("acme", 400), ("globex", 200)):
        response = planner_client.post(
            "/api/v1/reservations/",
            {"customer": customer, "model": "llama-8b", "mu_per_minute": mu},
            format="json",
        )
        assert response.status_code == 201
        ids.append(response.json()["id"])
    return ids


def metric(client, name, model="llama-8b") -> float:
    text = client.get("/metrics").content.decode()
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{model="{model}"}}'))
    return float(line.split()[-1])


def test_shrinking_a_pool_under_sold_reservations_is_refused_naming_them(
    planner_client, sold, pool
):
    response = planner_client.patch(POOL, {"gpu_count": 4}, format="json")
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "capacity_at_risk"
    assert sorted(r["id"] for r in error["details"]["reservations_at_risk"]) == sorted(sold)
    assert {r["customer"] for r in error["details"]["reservations_at_risk"]} == {"acme", "globex"}
    [model] = error["details"]["models"]
    # 4 GPUs sell 360 MU/min of the 600 sold.
    assert model["oversold_mu_per_minute"] == pytest.approx(240)
    assert model["binding_pools"] == ["us-east-h100"]
    pool.refresh_from_db()
    assert pool.gpu_count == 8
    # Shrinking to what still serves everything sold is fine (7 GPUs sell 630).
    assert planner_client.patch(POOL, {"gpu_count": 7}, format="json").status_code == 200
    assert not CapacityRisk.objects.filter(oversold_since__isnull=False).exists()


def test_forcing_it_needs_a_reason(planner_client, sold):
    response = planner_client.patch(POOL, {"gpu_count": 4, "force": True}, format="json")
    assert response.status_code == 400
    assert "force_reason" in response.json()["error"]["fields"]


def test_a_forced_shrink_puts_the_model_and_its_customers_into_the_oversold_state_once(
    planner_client, acme_key_client, globex_key_client, sold, receiver,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        response = planner_client.patch(
            POOL,
            {"gpu_count": 4, "force": True, "force_reason": "two GPUs failed their burn-in"},
            format="json",
        )
    assert response.status_code == 200, response.json()
    # Recorded: who forced it and why.
    forced = AuditEntry.objects.get(action="gpu_pool.update.forced")
    assert forced.reason == "two GPUs failed their burn-in"
    assert sorted(forced.after["reservations_at_risk"]) == sorted(sold)
    # The model's state, in the API.
    risk = planner_client.get("/api/v1/models/llama-8b/capacity").json()["risk"]
    assert risk["oversold"] is True
    assert risk["oversold_mu_per_minute"] == pytest.approx(240)
    assert risk["customers_at_risk"] == ["acme", "globex"]
    # Each customer sees its own reservation at risk, and no other's.
    for client, mine in ((acme_key_client, sold[0]), (globex_key_client, sold[1])):
        [reservation] = client.get("/api/v1/reservations/").json()["results"]
        assert (reservation["id"], reservation["at_risk"]) == (mine, True)
        utilisation = client.get(
            f"/api/v1/customers/{reservation['customer']}/utilisation?model=llama-8b"
        ).json()
        assert (utilisation["oversold"], utilisation["reservations_at_risk"]) == (True, [mine])
    # The gauge, read from the database when scraped.
    assert metric(planner_client, "mu_oversold_mu_per_minute") == pytest.approx(240)
    # One alert, signed (the receiver checks the signature and refuses replays).
    assert [hook.status for hook in receiver.received] == [200]
    alert = json.loads(receiver.received[0].raw_body)
    assert (alert["kind"], alert["state"], alert["model"]) == ("oversold", "entered", "llama-8b")
    assert alert["mu_per_minute"] == pytest.approx(240)
    assert sorted(alert["reservations_at_risk"]) == sorted(sold)
    # Re-checked by ticks, it stays oversold: no second alert.
    with django_capture_on_commit_callbacks(execute=True):
        fleet_recheck(now=timezone.now())
        fleet_recheck(now=timezone.now())
    assert len(receiver.received) == 1
    # Growing the pool back leaves the state, with one more alert.
    with django_capture_on_commit_callbacks(execute=True):
        assert planner_client.patch(POOL, {"gpu_count": 8}, format="json").status_code == 200
    assert metric(planner_client, "mu_oversold_mu_per_minute") == 0
    assert [json.loads(hook.raw_body)["state"] for hook in receiver.received] == [
        "entered",
        "left",
    ]
    assert acme_key_client.get("/api/v1/reservations/").json()["results"][0]["at_risk"] is False


def test_lowering_max_replicas_or_deleting_a_deployment_is_checked_too(planner_client, sold):
    lowered = planner_client.patch(
        "/api/v1/deployments/llama-8b-a/", {"max_replicas": 1}, format="json"
    )
    assert lowered.status_code == 409
    assert lowered.json()["error"]["code"] == "capacity_at_risk"
    deleted = planner_client.delete("/api/v1/deployments/llama-8b-b/")
    assert deleted.status_code == 409
    forced = planner_client.delete(
        "/api/v1/deployments/llama-8b-b/?force=true&force_reason=decommissioned"
    )
    assert forced.status_code == 204
    assert AuditEntry.objects.filter(action="deployment.delete.forced").count() == 1


def test_raising_headroom_or_lowering_overcommit_is_checked(planner_client, sold):
    response = planner_client.patch("/api/v1/models/llama-8b/", {"headroom": 0.5}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "capacity_at_risk"
    assert (
        planner_client.patch(
            "/api/v1/models/llama-8b/", {"overcommit": 1.2}, format="json"
        ).status_code
        == 200
    )


def test_lowering_overcommit_under_sold_reservations_is_refused_naming_them_unless_forced(
    planner_client, sold, served_model
):
    # 8 GPUs × 100 MU/min × 0.9 sell 720 at overcommit 1; at 0.5 they sell 360 of the 600 sold.
    refused = planner_client.patch("/api/v1/models/llama-8b/", {"overcommit": 0.5}, format="json")
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "capacity_at_risk"
    assert sorted(r["id"] for r in error["details"]["reservations_at_risk"]) == sorted(sold)
    assert {r["customer"] for r in error["details"]["reservations_at_risk"]} == {"acme", "globex"}
    [model] = error["details"]["models"]
    assert (model["model"], model["oversold_mu_per_minute"]) == ("llama-8b", pytest.approx(240))
    for reservation_id in sold:
        assert str(reservation_id) in error["message"]
    served_model.refresh_from_db()
    assert served_model.overcommit == 1.0
    assert not CapacityRisk.objects.filter(oversold_since__isnull=False).exists()

    forced = planner_client.patch(
        "/api/v1/models/llama-8b/",
        {"overcommit": 0.5, "force": True, "force_reason": "the SLO was tightened"},
        format="json",
    )

    assert forced.status_code == 200, forced.json()
    served_model.refresh_from_db()
    assert served_model.overcommit == 0.5
    entry = AuditEntry.objects.get(action="served_model.update.forced")
    assert entry.reason == "the SLO was tightened"
    assert sorted(entry.after["reservations_at_risk"]) == sorted(sold)
    risk = planner_client.get("/api/v1/models/llama-8b/capacity").json()["risk"]
    assert risk["oversold"] is True
    assert risk["oversold_mu_per_minute"] == pytest.approx(240)
    assert risk["customers_at_risk"] == ["acme", "globex"]
    assert metric(planner_client, "mu_oversold_mu_per_minute") == pytest.approx(240)


def test_activating_a_refit_that_lowers_an_exchange_rate_is_refused_unless_forced(
    planner_client, acme, served_model, gpu_type
):
    slow = GpuTypeFactory(name="L40S")
    pool = GpuPoolFactory(name="eu-l40s", gpu_type=slow, gpu_count=4)
    DeploymentFactory(name="llama-8b-l40s", served_model=served_model, gpu_pool=pool,
                      max_replicas=4)  # fmt: skip
    make_cost_model(served_model, gpu_type)  # the reference, on H100s (no H100 deployment)
    weights = {"input_tokens": 0.002, "output_tokens": 0.04, "request": 0.1}
    make_cost_model(served_model, slow, weights=weights)  # half as fast: 50 MU/min a replica
    served_model.headroom = 0.0
    served_model.save()
    assert (
        planner_client.post(
            "/api/v1/reservations/",
            {"customer": "acme", "model": "llama-8b", "mu_per_minute": 150},
            format="json",
        ).status_code
        == 201
    )
    # A re-fit finding the L40S four times slower: 25 MU/min a replica, 100 for the pool. Its
    # price change is far beyond the automatic limit, so it waits for a planner anyway.
    slower = make_cost_model(
        served_model, slow, weights={name: 2 * value for name, value in weights.items()}
    )
    assert slower.status == CostModel.Status.CANDIDATE
    response = planner_client.post(f"/api/v1/cost-models/{slower.pk}/activate/", {}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "capacity_at_risk"
    slower.refresh_from_db()
    assert slower.status == CostModel.Status.CANDIDATE
    forced = planner_client.post(
        f"/api/v1/cost-models/{slower.pk}/activate/",
        {"force": True, "reason": "the new driver is slower; more L40S are ordered"},
        format="json",
    )
    assert forced.status_code == 200
    assert CapacityRisk.objects.get(served_model=served_model).oversold_mu_per_minute == (
        pytest.approx(50)
    )


def test_the_ticks_guaranteed_shortfall_is_stored_shown_and_alerted_once(
    planner_client, acme, sellable, served_model, receiver, django_capture_on_commit_callbacks
):
    from datetime import timedelta

    from capacity.allocation.tick import allocation_tick
    from capacity.models import CapacitySample, Deployment, Reservation
    from capacity.tasks import capacity_sample

    # Sold while the deployment could run 8 replicas; now it may run 2 (written past the
    # services, as a migration or a hand edit would).
    Deployment.objects.filter(served_model=served_model).update(
        max_replicas=2, target_utilisation=1.0
    )
    Reservation.objects.create(
        customer=acme, served_model=served_model, mu_per_minute=500, keep_warm=True,
        starts_at=timezone.now() - timedelta(hours=1), status="active",
    )  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        allocation_tick()
        allocation_tick()
    capacity_sample()  # the minute's sample, a task of its own, reads what the tick stored
    risk = CapacityRisk.objects.get(served_model=served_model)
    # 2 replicas make 200 MU/min hot of the 500 kept warm; the fleet's GPUs serve 180 of it.
    assert risk.guaranteed_shortfall_mu_per_minute == pytest.approx(300)
    assert risk.oversold_mu_per_minute == pytest.approx(320)
    sample = CapacitySample.objects.get(served_model=served_model)
    assert sample.guaranteed_shortfall_mu_per_minute == pytest.approx(
        risk.guaranteed_shortfall_mu_per_minute
    )
    assert sample.oversold_mu_per_minute == pytest.approx(320)
    assert metric(planner_client, "mu_guaranteed_shortfall_mu_per_minute") == pytest.approx(
        risk.guaranteed_shortfall_mu_per_minute
    )
    summary = planner_client.get("/api/v1/models/llama-8b/capacity").json()["risk"]
    assert summary["guaranteed_shortfall_since"] is not None
    kinds = sorted(
        (json.loads(hook.raw_body)["kind"], json.loads(hook.raw_body)["state"])
        for hook in receiver.received
    )
    # Two ticks, one alert of each state entered.
    assert kinds == [("guaranteed_shortfall", "entered"), ("oversold", "entered")]


def test_the_admin_refuses_the_same_shrink_and_says_why(client, django_user_model, sold, pool):
    admin_user = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin_user)
    url = f"/admin/capacity/gpupool/{pool.pk}/change/"
    response = client.post(url, {"name": pool.name, "gpu_type": pool.gpu_type_id, "gpu_count": 4})
    assert response.status_code == 200  # the form again, with the error
    assert "would leave sold capacity unserved" in response.content.decode()
    pool.refresh_from_db()
    assert pool.gpu_count == 8
    assert not AuditEntry.objects.filter(action__endswith=".forced").exists()
    ok = client.post(url, {"name": pool.name, "gpu_type": pool.gpu_type_id, "gpu_count": 7})
    assert ok.status_code == 302
    pool.refresh_from_db()
    assert pool.gpu_count == 7

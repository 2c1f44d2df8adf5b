"""Two models on one 8-GPU pool compete for its GPUs: what is sold of both must fit at once."""

import math
import random
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from capacity.models import Reservation
from capacity.selling.reservations import reservation_create
from capacity.selling.sellable import (
    available_for,
    joint_fleet,
    model_capacity,
    sold_moments,
)
from core.errors import ConflictError
from tests.conftest import make_cost_model
from tests.support.factories import (
    CustomerFactory,
    DeploymentFactory,
    GpuPoolFactory,
    ServedModelFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
URL = "/api/v1/reservations/"


@pytest.fixture
def shared(gpu_type):
    """llama and qwen on one 8-GPU pool. A llama replica takes 1 GPU, a qwen replica 2; each
    mints 100 MU/min and 10 % is headroom: llama sells 90 MU/min per GPU, qwen 45."""
    pool = GpuPoolFactory(name="shared-h100", gpu_type=gpu_type, gpu_count=8)
    llama = ServedModelFactory(name="llama", reference_gpu_type=gpu_type, headroom=0.1)
    qwen = ServedModelFactory(name="qwen", reference_gpu_type=gpu_type, headroom=0.1)
    DeploymentFactory(name="llama-h100", served_model=llama, gpu_pool=pool, max_replicas=8)
    DeploymentFactory(
        name="qwen-h100", served_model=qwen, gpu_pool=pool, gpus_per_replica=2, max_replicas=4
    )
    make_cost_model(llama, gpu_type)
    make_cost_model(qwen, gpu_type, gpus_per_replica=2)
    return llama, qwen


def sell(client, model, mu, **extra):
    body = {"customer": "acme", "model": model, "mu_per_minute": mu} | extra
    return client.post(URL, body, format="json")


@pytest.mark.parametrize("first", ["llama", "qwen"])
def test_the_sale_that_breaks_a_shared_pool_is_refused_whatever_the_order(
    planner_client, acme, shared, first
):
    # Alone, either model could sell the whole pool: llama 720, qwen 360.
    second = {"llama": "qwen", "qwen": "llama"}[first]
    half = {"llama": 360, "qwen": 180}  # four GPUs' worth each
    assert sell(planner_client, first, half[first]).status_code == 201
    refused = sell(planner_client, second, half[second] + 9)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "insufficient_capacity"
    details = error["details"]
    assert details["binding_pools"] == ["shared-h100"]
    assert details["models_sharing_pools"] == [first]
    assert details["sold_mu_per_minute"] == 0
    assert details["sellable_mu_per_minute"] == pytest.approx(half[second])
    assert details["shortfall_mu_per_minute"] == pytest.approx(9)
    assert "shared-h100" in error["message"]
    # What is left of the pool sells exactly, and then nothing more, to either model.
    assert sell(planner_client, second, half[second]).status_code == 201
    assert sell(planner_client, first, 1).status_code == 409
    assert sell(planner_client, second, 1).status_code == 409
    assert Reservation.objects.count() == 2


@pytest.mark.parametrize("first", ["llama", "qwen"])
def test_sales_that_fit_only_in_split_replicas_are_refused_whole_replicas_are_what_a_pool_holds(
    planner_client, acme, shared, first
):
    # 405 MU/min of llama is 4.5 replicas of 1 GPU, 157.5 of qwen 1.75 replicas of 2 GPUs:
    # 8 GPUs if replicas could be split, 5 + 4 = 9 whole ones.
    llama, qwen = shared
    wanted = {"llama": 405, "qwen": 157.5}
    second = {"llama": "qwen", "qwen": "llama"}[first]
    assert sell(planner_client, first, wanted[first]).status_code == 201
    # The relaxation alone would sell it: exactly what is left of the pool, split.
    fleet = joint_fleet([llama.pk, qwen.pk])
    sold = sold_moments(fleet, start=timezone.now())
    model = {"llama": llama, "qwen": qwen}[second]
    split = fleet.programme.available(sold.demand, model.pk).mu_per_minute
    assert split == pytest.approx(wanted[second])

    refused = sell(planner_client, second, wanted[second])

    assert refused.status_code == 409, refused.json()
    error = refused.json()["error"]
    assert error["code"] == "insufficient_capacity"
    details = error["details"]
    # What whole replicas leave: qwen one replica (3 GPUs free), llama four (4 GPUs free).
    whole = {"qwen": 90, "llama": 360}[second]
    assert details["sellable_mu_per_minute"] == pytest.approx(whole)
    assert details["shortfall_mu_per_minute"] == pytest.approx(wanted[second] - whole)
    assert details["binding_pools"] == ["shared-h100"]
    assert f"{whole:g} MU/min is sellable" in error["message"]
    # The figures a planner reads say the same before selling.
    assert model_capacity(model).available_mu_per_minute == pytest.approx(whole)
    assert model_capacity(model).sellable_mu_per_minute == pytest.approx(whole)
    assert sell(planner_client, second, whole).status_code == 201
    assert sell(planner_client, second, 1).status_code == 409
    assert Reservation.objects.count() == 2


def test_the_sellable_figure_is_what_remains_given_the_other_models_sales(
    planner_client, acme, shared
):
    llama, qwen = shared
    assert model_capacity(llama).sellable_mu_per_minute == pytest.approx(720)
    assert sell(planner_client, "qwen", 90).status_code == 201  # 2 GPUs of qwen
    tomorrow = timezone.now() + timedelta(days=1)
    later = sell(planner_client, "qwen", 90, starts_at=tomorrow.isoformat())
    assert later.status_code == 201  # 2 more GPUs from tomorrow on
    llama_now = model_capacity(llama)
    # Now llama could have 6 GPUs; an open-ended sale from now only 4, for tomorrow's sake.
    assert llama_now.sellable_mu_per_minute == pytest.approx(540)
    assert llama_now.available_mu_per_minute == pytest.approx(360)
    assert llama_now.deployable_mu_per_minute == pytest.approx(800)  # the pool, alone
    summary = planner_client.get("/api/v1/models/llama/capacity").json()
    assert summary["sellable_mu_per_minute"] == pytest.approx(540)
    assert summary["available_mu_per_minute"] == pytest.approx(360)
    # A sale of llama that ends before tomorrow may take the 6 GPUs.
    assert sell(planner_client, "llama", 540, ends_at=tomorrow.isoformat()).status_code == 201
    assert sell(planner_client, "llama", 1, ends_at=tomorrow.isoformat()).status_code == 409
    after = sell(planner_client, "llama", 360, starts_at=tomorrow.isoformat())
    assert after.status_code == 201


def test_amending_up_is_checked_against_the_other_models(planner_client, acme, shared):
    llama = sell(planner_client, "llama", 360).json()
    assert sell(planner_client, "qwen", 180).status_code == 201
    grown = planner_client.patch(f"{URL}{llama['id']}/", {"mu_per_minute": 400}, format="json")
    assert grown.status_code == 409
    assert grown.json()["error"]["details"]["binding_pools"] == ["shared-h100"]


def test_a_model_in_another_pool_is_not_held_back(planner_client, acme, shared, gpu_type):
    llama, _ = shared
    own = GpuPoolFactory(name="own-h100", gpu_type=gpu_type, gpu_count=2)
    DeploymentFactory(name="llama-own", served_model=llama, gpu_pool=own, max_replicas=2)
    assert sell(planner_client, "qwen", 360).status_code == 201  # the whole shared pool
    assert model_capacity(llama).sellable_mu_per_minute == pytest.approx(180)
    assert sell(planner_client, "llama", 180).status_code == 201
    assert sell(planner_client, "llama", 1).status_code == 409


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql_only
def test_fifty_concurrent_sales_across_two_models_never_oversell(many_db_connections, shared):
    llama, qwen = shared
    customer = CustomerFactory(slug="acme")
    rng = random.Random(7)
    orders = [(rng.choice([llama, qwen]), rng.choice([20, 30, 45])) for _ in range(50)]
    barrier = threading.Barrier(len(orders))
    outcomes: list[tuple[str, float, bool]] = []

    def buy(model, mu):
        try:
            barrier.wait()
            try:
                reservation_create(customer=customer, served_model=model, mu_per_minute=mu)
                outcomes.append((model.name, mu, True))
            except ConflictError:
                outcomes.append((model.name, mu, False))
        finally:
            connection.close()

    threads = [threading.Thread(target=buy, args=order) for order in orders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(outcomes) == 50
    sold = {
        name: sum(mu for model, mu, ok in outcomes if ok and model == name)
        for name in ("llama", "qwen")
    }
    stored = {
        name: sum(
            Reservation.objects.filter(served_model__name=name).values_list(
                "mu_per_minute", flat=True
            )
        )
        for name in ("llama", "qwen")
    }
    assert stored == pytest.approx(sold)
    # Never oversold: in whole replicas (90 MU/min each; llama's take 1 GPU, qwen's 2), what
    # was sold needs no more than the 8 GPUs.
    assert math.ceil(sold["llama"] / 90 - 1e-9) + 2 * math.ceil(sold["qwen"] / 90 - 1e-9) <= 8
    # The programmes' own answer, on what was sold: it all fits, and every refusal was right
    # (what is sold only grew, so what was left when a sale was refused was no more than now).
    fleet = joint_fleet([llama.pk, qwen.pk])
    now = timezone.now()
    for model in (llama, qwen):
        left = available_for(fleet, sold_moments(fleet, start=now), model.pk).mu_per_minute
        assert left >= -1e-6
        refused = [mu for name, mu, ok in outcomes if name == model.name and not ok]
        if refused:
            assert left < min(refused)
    assert any(not ok for _, _, ok in outcomes)  # the pool was really contended

import threading
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from capacity.models import Reservation
from capacity.selling.reservations import reservation_create, reservations_refresh_status
from capacity.selling.sellable import model_capacity
from tests.conftest import make_cost_model
from tests.support.factories import DeploymentFactory, GpuPoolFactory, GpuTypeFactory
from tests.support.servers import gunicorn_server

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]
URL = "/api/v1/reservations/"


def sell(client, mu, **extra):
    body = {"customer": "acme", "model": "llama-8b", "mu_per_minute": mu} | extra
    return client.post(URL, body, format="json")


def test_sellable_capacity_is_deployable_times_headroom_and_overcommit(sellable, served_model):
    capacity = model_capacity(served_model)
    assert capacity.deployable_mu_per_minute == pytest.approx(800)
    assert capacity.sellable_mu_per_minute == pytest.approx(720)
    served_model.overcommit = 1.5
    served_model.save()
    assert model_capacity(served_model).sellable_mu_per_minute == pytest.approx(1080)


def test_a_shared_pool_is_counted_once(sellable, served_model, pool):
    # A second deployment of the same model in the same 8-GPU pool adds no GPUs.
    DeploymentFactory(name="llama-8b-h100-b", served_model=served_model, gpu_pool=pool,
                      max_replicas=8)  # fmt: skip
    assert model_capacity(served_model).deployable_mu_per_minute == pytest.approx(800)


def test_another_gpu_type_mints_mu_at_the_exchange_rate(sellable, served_model):
    slow = GpuTypeFactory(name="L40S")
    DeploymentFactory(
        name="llama-8b-l40s",
        served_model=served_model,
        gpu_pool=GpuPoolFactory(name="eu-l40s", gpu_type=slow, gpu_count=4),
        max_replicas=4,
    )
    # Every request takes twice as long on the L40S: a replica mints 50 MU/min.
    make_cost_model(served_model, slow, weights={
        "input_tokens": 0.002, "output_tokens": 0.04, "request": 0.1})  # fmt: skip
    capacity = model_capacity(served_model)
    l40s = next(d for d in capacity.deployments if d.name == "llama-8b-l40s")
    assert l40s.mu_per_minute_per_replica == pytest.approx(50)
    assert capacity.deployable_mu_per_minute == pytest.approx(800 + 4 * 50)


def test_a_deployment_without_a_cost_model_sells_nothing_and_says_why(sellable, served_model):
    other = GpuTypeFactory(name="A100")
    DeploymentFactory(name="llama-8b-a100", served_model=served_model,
                      gpu_pool=GpuPoolFactory(gpu_type=other), max_replicas=2)  # fmt: skip
    capacity = model_capacity(served_model)
    a100 = next(d for d in capacity.deployments if d.name == "llama-8b-a100")
    assert a100.deployable_mu_per_minute == 0
    assert "no active cost model" in a100.note


def test_a_planner_sells_what_fits_and_a_sale_that_does_not_is_refused_with_numbers(
    planner_client, sellable, acme
):
    assert sell(planner_client, 500).status_code == 201
    response = sell(planner_client, 300)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "insufficient_capacity"
    details = error["details"]
    assert details["requested_mu_per_minute"] == 300
    assert details["sellable_mu_per_minute"] == pytest.approx(720)
    assert details["sold_mu_per_minute"] == pytest.approx(500)
    assert details["shortfall_mu_per_minute"] == pytest.approx(80)
    assert Reservation.objects.count() == 1


def test_only_overlapping_terms_count(planner_client, sellable, acme):
    now = timezone.now()
    first = sell(planner_client, 700, starts_at=(now + timedelta(days=1)).isoformat(),
                 ends_at=(now + timedelta(days=2)).isoformat())  # fmt: skip
    assert first.status_code == 201
    # Before and after that term, the whole 720 is free.
    before = sell(planner_client, 700, ends_at=(now + timedelta(days=1)).isoformat())
    after = sell(planner_client, 700, starts_at=(now + timedelta(days=2)).isoformat())
    assert (before.status_code, after.status_code) == (201, 201)
    # An open-ended sale overlaps everything.
    assert sell(planner_client, 30).status_code == 409


def test_amending_up_rechecks_and_down_always_succeeds(planner_client, sellable, acme):
    reservation = sell(planner_client, 600).json()
    url = f"{URL}{reservation['id']}/"
    too_much = planner_client.patch(url, {"mu_per_minute": 800}, format="json")
    assert too_much.status_code == 409
    assert too_much.json()["error"]["details"]["sold_mu_per_minute"] == 0  # itself excluded
    assert planner_client.patch(url, {"mu_per_minute": 720}, format="json").status_code == 200
    assert planner_client.patch(url, {"mu_per_minute": 10}, format="json").status_code == 200
    history = planner_client.get(url + "history/").json()
    assert [change["kind"] for change in history] == ["created", "amended", "amended"]
    assert history[1]["changes"]["mu_per_minute"] == [600, 720]


def test_cancelled_reservations_free_capacity(planner_client, sellable, acme):
    reservation = sell(planner_client, 700).json()
    assert sell(planner_client, 100).status_code == 409
    cancelled = planner_client.post(f"{URL}{reservation['id']}/cancel/")
    assert cancelled.json()["status"] == "cancelled"
    assert sell(planner_client, 100).status_code == 201
    assert planner_client.post(f"{URL}{reservation['id']}/cancel/").status_code == 409


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"mu_per_minute": -5}, "mu_per_minute"),
        ({"mu_per_minute": "lots"}, "mu_per_minute"),
        ({"model": "ghost"}, "model"),
        ({"customer": "nobody"}, "customer"),
        ({"ends_at": "yesterday"}, "ends_at"),
    ],
)
def test_bad_reservations_are_400_naming_the_field(planner_client, sellable, acme, body, field):
    base = {"customer": "acme", "model": "llama-8b", "mu_per_minute": 10}
    response = planner_client.post(URL, base | body, format="json")
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]


def test_a_reservation_to_year_9999_is_a_400_naming_ends_at(planner_client, sellable, acme):
    response = sell(planner_client, 10, ends_at="9999-12-31T00:00:00Z")
    assert response.status_code == 400
    assert "ends_at" in response.json()["error"]["fields"]
    now = timezone.now()
    response = sell(planner_client, 10, ends_at=(now + timedelta(days=3651)).isoformat())
    assert response.status_code == 400
    assert "3650 days" in response.json()["error"]["fields"]["ends_at"][0]
    # The longest term itself is sold.
    longest = sell(planner_client, 10, starts_at=(now + timedelta(days=1)).isoformat(),
                   ends_at=(now + timedelta(days=3651)).isoformat())  # fmt: skip
    assert longest.status_code == 201, longest.json()
    assert Reservation.objects.count() == 1


@pytest.mark.parametrize(
    "starts_at",
    ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "2999-01-01T00:00:00Z", "1971-01-01T00:00Z"],
)
def test_a_reservation_starting_implausibly_far_from_now_is_a_400_naming_starts_at(
    planner_client, sellable, acme, starts_at
):
    response = sell(planner_client, 10, starts_at=starts_at)
    assert response.status_code == 400, response.json()
    assert "starts_at" in response.json()["error"]["fields"]
    assert not Reservation.objects.exists()


def test_a_megabyte_of_notes_is_a_400_naming_notes(planner_client, sellable, acme):
    response = sell(planner_client, 10, notes="x" * 1_000_000)
    assert response.status_code == 400
    assert "2000" in response.json()["error"]["fields"]["notes"][0]
    assert not Reservation.objects.exists()
    assert sell(planner_client, 10, notes="y" * 2000).status_code == 201
    reservation = Reservation.objects.get()
    response = planner_client.patch(f"{URL}{reservation.pk}/", {"notes": "z" * 2001},
                                    format="json")  # fmt: skip
    assert response.status_code == 400
    assert "notes" in response.json()["error"]["fields"]
    reservation.refresh_from_db()
    assert reservation.notes == "y" * 2000


def test_an_amendment_may_not_stretch_a_term_past_the_longest_but_may_end_an_old_one(
    planner_client, sellable, acme, served_model
):
    now = timezone.now()
    # Sold eleven years ago, open-ended: ending it is always allowed.
    old = Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=5,
        starts_at=now - timedelta(days=4000),
        status="active",
    )
    ending = planner_client.patch(f"{URL}{old.pk}/",
                                  {"ends_at": (now + timedelta(days=30)).isoformat()},
                                  format="json")  # fmt: skip
    assert ending.status_code == 200, ending.json()
    recent = sell(planner_client, 5, ends_at=(now + timedelta(days=30)).isoformat()).json()
    stretched = planner_client.patch(
        f"{URL}{recent['id']}/", {"ends_at": "9999-12-31T00:00:00Z"}, format="json"
    )
    assert stretched.status_code == 400
    assert "ends_at" in stretched.json()["error"]["fields"]
    assert Reservation.objects.get(pk=recent["id"]).ends_at < now + timedelta(days=31)


def test_an_end_before_the_start_is_refused(planner_client, sellable, acme):
    now = timezone.now()
    response = sell(planner_client, 10, starts_at=(now + timedelta(days=2)).isoformat(),
                    ends_at=(now + timedelta(days=1)).isoformat())  # fmt: skip
    assert response.status_code == 400
    assert "ends_at" in response.json()["error"]["fields"]


def test_customers_read_their_own_reservations_only_and_cannot_sell(
    planner_client, acme_key_client, globex_key_client, sellable, acme
):
    reservation = sell(planner_client, 100).json()
    assert acme_key_client.get(URL).json()["count"] == 1
    assert globex_key_client.get(URL).json()["count"] == 0
    assert globex_key_client.get(f"{URL}{reservation['id']}/").status_code == 404
    assert sell(acme_key_client, 10).status_code == 403


def test_a_provisioning_key_sells(make_key, key_client, sellable, acme):
    _, plaintext = make_key(service_name="provisioner", scopes=["read", "reservations:write"])
    assert sell(key_client(plaintext), 50).status_code == 201


def test_status_follows_time(sellable, served_model, acme):
    now = timezone.now()
    later = reservation_create(customer=acme, served_model=served_model, mu_per_minute=10,
                               starts_at=now + timedelta(minutes=5),
                               ends_at=now + timedelta(minutes=10))  # fmt: skip
    assert later.status == "pending"
    reservations_refresh_status(now=now + timedelta(minutes=6))
    later.refresh_from_db()
    assert later.status == "active"
    reservations_refresh_status(now=now + timedelta(minutes=11))
    later.refresh_from_db()
    assert later.status == "expired"


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql_only
def test_fifty_concurrent_sales_never_oversell(sellable, acme, make_key, tmp_path):
    _, plaintext = make_key(service_name="provisioner", scopes=["read", "reservations:write"])
    barrier = threading.Barrier(50)
    statuses = []

    def buy(url):
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            barrier.wait()
            response = client.post(
                URL,
                json={"customer": "acme", "model": "llama-8b", "mu_per_minute": 25},
                headers={"Authorization": f"Bearer {plaintext}"},
            )
            statuses.append(response.status_code)

    with gunicorn_server(tmp_path) as url:
        threads = [threading.Thread(target=buy, args=(url,)) for _ in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # 50 × 25 = 1250 MU/min asked for; 720 is sellable: exactly 28 sales fit.
    assert statuses.count(201) == 28
    assert statuses.count(409) == 22
    sold = sum(Reservation.objects.values_list("mu_per_minute", flat=True))
    assert sold == pytest.approx(700)
    assert sold <= 720

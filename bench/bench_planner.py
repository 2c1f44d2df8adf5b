"""The planner UI with 10,000 customers, each with an active reservation and a day of usage
minutes: the customers page (reserved, used and refusals per row, 50 rows a page) beside the
API's customers list of the same page size on the same data and stack (GET /api/v1/customers/,
which carries no totals). Both through Django's test client in this process, logged in as a
planner, medians over interleaved rounds.
"""

from datetime import timedelta

from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from accounts.models import Customer
from accounts.principals import PLANNERS_GROUP
from bench.figures import Figure
from bench.timing import median_latencies
from capacity.models import Deployment, GpuPool, GpuType, Reservation, ServedModel, UsageMinute
from capacity.pricing.features import mu_coefficients
from capacity.repricing.services import cost_model_record

CUSTOMERS = 10_000
USAGE_MINUTES_PER_CUSTOMER = 24  # one an hour over the last day
MS = 1000.0


def _fixture() -> Client:
    from django.contrib.auth import get_user_model

    gpu = GpuType.objects.create(name="bench-h100", memory_gb=80, hourly_cost_usd=4)
    pool = GpuPool.objects.create(name="bench-pool", gpu_type=gpu, gpu_count=10_000)
    model = ServedModel.objects.create(
        name="bench-planner", engine_model_id="m", parameters_billions=8,
        reference_gpu_type=gpu, context_length_tokens=8192,
    )  # fmt: skip
    Deployment.objects.create(name="bench-planner", served_model=model, gpu_pool=pool)
    weights = {"input_tokens": 1e-4, "output_tokens": 2e-3, "request": 0.01}
    cost_model_record(
        served_model=model, gpu_type=gpu, gpus_per_replica=1, features=list(weights),
        weights_replica_seconds=weights, mu_per_unit=mu_coefficients(weights),
        sample_count=10, distinct_shapes=10, cv_mape=0.01, cv_worst_error=0.02,
        candidates=[], residuals=[],
    )  # fmt: skip
    customers = Customer.objects.bulk_create(
        [Customer(name=f"Customer {i:05d}", slug=f"c{i:05d}") for i in range(CUSTOMERS)]
    )
    now = timezone.now().replace(second=0, microsecond=0)
    Reservation.objects.bulk_create(
        [
            Reservation(
                customer=c,
                served_model=model,
                mu_per_minute=10,
                starts_at=now - timedelta(days=1),
                status=Reservation.Status.ACTIVE,
            )  # fmt: skip
            for c in customers
        ],
        batch_size=5000,
    )
    UsageMinute.objects.bulk_create(
        [
            UsageMinute(
                customer=c,
                served_model=model,
                minute=now - timedelta(hours=h),
                requests=20,
                refused_requests=h % 3,
                mu=240.0,
            )  # fmt: skip
            for c in customers
            for h in range(USAGE_MINUTES_PER_CUSTOMER)
        ],
        batch_size=10_000,
    )
    user = get_user_model().objects.create_user("bench-planner", password="x", is_staff=True)
    user.groups.add(Group.objects.get_or_create(name=PLANNERS_GROUP)[0])
    client = Client()
    client.force_login(user)
    return client


def _get(client: Client, path: str):
    def call():
        response = client.get(path)
        if response.status_code != 200:
            raise AssertionError(f"GET {path}: {response.status_code}")
        return response

    return call


def run() -> list[Figure]:
    client = _fixture()
    first = _get(client, "/planner/customers/")
    last = _get(client, "/planner/customers/?page=200")
    api = _get(client, "/api/v1/customers/")
    if b"Page 200 of 200 (10000 in all)" not in last().content:
        raise AssertionError("expected 200 pages of 50 customers")
    times = median_latencies(
        {"first": first, "last": last, "api": api}, iterations=20, rounds=5, warmup=5
    )
    what = "GET /api/v1/customers/ (50 rows, no totals)"
    return [
        Figure("customers_page_1_latency", times["first"] * MS, "ms/page", times["api"] * MS, what),
        Figure(
            "customers_page_200_latency", times["last"] * MS, "ms/page", times["api"] * MS, what
        ),
    ]

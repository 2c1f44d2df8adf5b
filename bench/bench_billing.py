"""Generating a month's invoices for 1,000 customers, beside the aggregation query alone.

A month (November 2026) of minute rollups for 1,000 customers on one model, one active minute
in 30 (1.44 M rows), every tenth minute row with a guaranteed refusal, and a reservation for
every other customer. `invoice_generate` reads reservations, rate cards and rollups, builds
every line and writes the drafts; the baseline is the one query its best-effort lines rest on
(best-effort MU per customer over the month), run on the same rows in the same run.
"""

import time
from datetime import UTC, datetime
from decimal import Decimal

from django.db import connection
from django.db.models import F, Sum

from accounts.services import customer_create
from bench.figures import Figure
from billing.generation import invoice_generate
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.models import GpuType, Reservation, ServedModel, UsageMinute

CUSTOMERS = 1000
START = datetime(2026, 11, 1, tzinfo=UTC)
END = datetime(2026, 12, 1, tzinfo=UTC)


def _fixture() -> ServedModel:
    gpu = GpuType.objects.create(name="BENCH-BILL-GPU", memory_gb=80, hourly_cost_usd=2)
    model = ServedModel.objects.create(
        name="bench-billing", engine_model_id="bench", parameters_billions=8,
        reference_gpu_type=gpu, context_length_tokens=8192,
    )  # fmt: skip
    rate_card_create(
        served_model=model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    rate_card_create(
        served_model=model,
        effective_from=datetime(2026, 11, 16, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.12"),
        best_effort_price_per_1000_mu=Decimal("2.40"),
    )
    customers = [
        customer_create(name=f"Bench bill {n}", slug=f"bench-bill-{n}").pk for n in range(CUSTOMERS)
    ]
    Reservation.objects.bulk_create(
        Reservation(customer_id=c, served_model=model, mu_per_minute=50, starts_at=START,
                    status="active")
        for c in customers[::2]
    )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO capacity_usageminute (customer_id, served_model_id, minute, requests,
                refused_requests, guaranteed_refused_requests, input_tokens,
                cached_input_tokens, output_tokens, mu, guaranteed_mu, best_effort_mu)
            SELECT c, %s, m, 10, 0, (extract(epoch FROM m)::bigint / 1800 %% 10 = 0)::int,
                   10000, 0, 2000, 80, 20, 60
            FROM unnest(%s::bigint[]) AS c,
                 generate_series(%s::timestamptz, %s::timestamptz - interval '1 minute',
                                 interval '30 minutes') AS m
            """,
            [model.pk, customers, START, END],
        )
        cursor.execute("ANALYZE capacity_usageminute")
    return model


def run() -> list[Figure]:
    _fixture()
    started = time.perf_counter()
    rows = list(
        UsageMinute.objects.filter(minute__gte=START, minute__lt=END)
        .values("customer_id", "served_model_id")
        .annotate(mu=Sum(F("mu") - F("guaranteed_mu")))
    )
    query_s = time.perf_counter() - started
    if len(rows) != CUSTOMERS:
        raise AssertionError(f"expected {CUSTOMERS} customers of usage, got {len(rows)}")
    started = time.perf_counter()
    result = invoice_generate(period="2026-11")
    generate_s = time.perf_counter() - started
    if result.drafts != CUSTOMERS or Invoice.objects.count() != CUSTOMERS:
        raise AssertionError(f"expected {CUSTOMERS} drafts, got {result.drafts}")
    return [
        Figure(
            name=f"generate_invoices_{CUSTOMERS}_customers_month",
            value=generate_s,
            unit="s",
            baseline=query_s,
            baseline_name="the month's best-effort aggregation query alone",
        )
    ]

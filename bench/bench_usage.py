"""Usage metering at volume.

- ingestion: events/s through `POST /api/v1/usage/events` (one gunicorn worker process with
  4 threads, as deployed, so one request's database round trips overlap another's Python;
  PostgreSQL; batches of 5,000 from 4 clients sending back to back), beside PostgreSQL's own
  `COPY` of the same rows into a table with the same columns and indexes (foreign keys are not
  copied by LIKE, so the baseline is the faster for it), on the same machine.
- utilisation: p95 latency of the utilisation query (30 days, one step per day) over 30 days
  of minute rollups for 100 customers, beside one plain aggregate (count, sum, max) over the
  same rows: the least any query over them must pay.
"""

import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from django.db import connection

from accounts.services import api_key_create, customer_create
from bench.figures import Figure
from capacity.metering.utilisation import customer_utilisation
from capacity.models import GpuType, ServedModel
from capacity.pricing.cost_models import cost_model_record
from capacity.pricing.features import mu_coefficients

ROOT = Path(__file__).resolve().parent.parent
BATCH = 5_000
BATCHES = 20
CUSTOMERS = 100
DAYS = 30
UTILISATION_QUERIES = 40
CLIENTS = 4
WEIGHTS = {"input_tokens": 1e-4, "output_tokens": 2e-2, "output_sq_per_1000": 1e-3,
           "request": 5e-2}  # fmt: skip


def _catalog():
    gpu = GpuType.objects.create(name="BENCH-GPU", memory_gb=80, hourly_cost_usd=2)
    model = ServedModel.objects.create(
        name="bench-model", engine_model_id="bench", parameters_billions=8,
        reference_gpu_type=gpu, context_length_tokens=8192,
    )  # fmt: skip
    cost_model_record(
        served_model=model, gpu_type=gpu, gpus_per_replica=1, features=list(WEIGHTS),
        weights_replica_seconds=WEIGHTS, mu_per_unit=mu_coefficients(WEIGHTS), sample_count=10,
        distinct_shapes=10, cv_mape=0.01, cv_worst_error=0.02, candidates=[], residuals=[],
    )  # fmt: skip
    return model


def _events(customer_slug: str) -> list[dict]:
    now = datetime.now(UTC) - timedelta(minutes=5)
    events = []
    for index in range(BATCH * BATCHES):
        finished = now - timedelta(milliseconds=index * 7)
        events.append(
            {
                "event_id": f"bench-{index:09d}",
                "customer": customer_slug,
                "model": "bench-model",
                "started_at": (finished - timedelta(seconds=2)).isoformat(),
                "finished_at": finished.isoformat(),
                "input_tokens": 500 + index % 3000,
                "cached_input_tokens": index % 200,
                "output_tokens": 20 + index % 400,
                "images": 0,
                "outcome": "completed",
                "admission_class": ("guaranteed", "best_effort")[index % 2],
                "ttft_ms": 80.0 + index % 50,
            }
        )
    return events


def _database_url() -> str:
    settings_dict = connection.settings_dict
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    user = settings_dict.get("USER") or "postgres"
    return f"postgres://{user}@{host}:{port}/{settings_dict['NAME']}"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ingest_through_api(bodies: list[bytes], key: str) -> float:
    port = _free_port()
    env = os.environ | {"DATABASE_URL": _database_url(), "SECURE_SSL_REDIRECT": "0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "controlplane.wsgi:application", "--bind",
         f"127.0.0.1:{port}", "--workers", "1", "--threads", str(CLIENTS), "--timeout", "300"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(url + "/healthz", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        failures = []

        def send(share: list[bytes]) -> None:
            with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
                for body in share:
                    response = client.post("/api/v1/usage/events", content=body, headers=headers)
                    if response.status_code != 200 or response.json()["accepted_count"] != BATCH:
                        failures.append(response.text[:300])

        threads = [
            threading.Thread(target=send, args=(bodies[n::CLIENTS],)) for n in range(CLIENTS)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        if failures:
            raise AssertionError(f"ingestion failed: {failures[0]}")
    finally:
        process.terminate()
        process.wait(timeout=20)
    return len(bodies) * BATCH / seconds


def _copy_baseline() -> float:
    """COPY the rows the API stored into a twin table with the same columns and indexes."""
    columns = (
        "event_id, customer_id, served_model_id, deployment_id, started_at, finished_at, minute, "
        "input_tokens, cached_input_tokens, output_tokens, images, outcome, admission_class, "
        "verification, self_reported, ttft_ms, mu, cost_model_id, ingested_at, rolled_up"
    )
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM capacity_usageevent")  # noqa: S608
        rows = cursor.fetchall()
        buffer = io.StringIO()
        for row in rows:
            buffer.write("\t".join("\\N" if v is None else str(v) for v in row) + "\n")
        data = buffer.getvalue()
        cursor.execute("CREATE TABLE bench_copy_twin (LIKE capacity_usageevent INCLUDING ALL)")
        raw = cursor.connection  # psycopg 3 connection
        started = time.perf_counter()
        with raw.cursor().copy(f"COPY bench_copy_twin ({columns}) FROM STDIN") as copy:
            copy.write(data)
        connection.commit() if not connection.get_autocommit() else None
        seconds = time.perf_counter() - started
        cursor.execute("DROP TABLE bench_copy_twin")
    return len(rows) / seconds


def _fill_rollups(model_id: int) -> tuple[list[int], datetime]:
    customers = [
        customer_create(name=f"Bench {n}", slug=f"bench-util-{n}").pk for n in range(CUSTOMERS)
    ]
    end = datetime.now(UTC).replace(second=0, microsecond=0)
    start = end - timedelta(days=DAYS)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO capacity_usageminute (customer_id, served_model_id, minute, requests,
                refused_requests, guaranteed_refused_requests, input_tokens,
                cached_input_tokens, output_tokens, mu, guaranteed_mu, best_effort_mu)
            SELECT c, %s, m, 10, (random() < 0.01)::int, 0, 10000, 0, 2000,
                   random() * 100, random() * 60, random() * 40
            FROM unnest(%s::bigint[]) AS c,
                 generate_series(%s::timestamptz, %s::timestamptz - interval '1 minute',
                                 interval '1 minute') AS m
            """,
            [model_id, customers, start, end],
        )
        cursor.execute("ANALYZE capacity_usageminute")
    return customers, start


def run() -> list[Figure]:
    model = _catalog()
    customer = customer_create(name="Bench ingest", slug="bench-ingest")
    # A platform gateway's key, naming the customer: customers' own keys post usage only
    # when a planner allows it.
    key = api_key_create(name="bench", service_name="bench-gateway", scopes=["usage:write"])
    events = _events(customer.slug)
    bodies = [
        json.dumps({"events": events[i : i + BATCH]}).encode() for i in range(0, len(events), BATCH)
    ]
    api_events_per_s = _ingest_through_api(bodies, key.plaintext)
    copy_events_per_s = _copy_baseline()

    customers, start = _fill_rollups(model.pk)
    from accounts.models import Customer

    query_ms, fetch_ms = [], []
    for n in range(UTILISATION_QUERIES):
        target = Customer.objects.get(pk=customers[n % CUSTOMERS])
        began = time.perf_counter()
        steps = customer_utilisation(
            customer=target,
            served_model=model,
            start=start,
            end=start + timedelta(days=DAYS),
            step=timedelta(days=1),
        )
        query_ms.append((time.perf_counter() - began) * 1000)
        assert len(steps) == DAYS
        began = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*), sum(mu), max(mu) "
                "FROM capacity_usageminute WHERE customer_id = %s AND served_model_id = %s "
                "AND minute >= %s AND minute < %s",
                [target.pk, model.pk, start, start + timedelta(days=DAYS)],
            )
            cursor.fetchall()
        fetch_ms.append((time.perf_counter() - began) * 1000)

    def p95(values):
        return statistics.quantiles(values, n=20)[-1]

    return [
        Figure(
            name="ingest_events_per_s_http",
            value=api_events_per_s,
            unit="events/s",
            baseline=copy_events_per_s,
            baseline_name="PostgreSQL COPY of the same rows",
        ),
        Figure(
            name="utilisation_query_p95_30d",
            value=p95(query_ms),
            unit="ms",
            baseline=p95(fetch_ms),
            baseline_name="one sum over the same 43,200 rollup rows",
        ),
    ]

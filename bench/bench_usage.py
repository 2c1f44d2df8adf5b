"""Usage metering at volume.

- ingestion (issue 24, item 1): events/s through `POST /api/v1/usage/events` (gunicorn worker
  processes with 4 threads each, as deployed, so one request's database round trips overlap
  another's Python; PostgreSQL; 4 clients per worker sending batches back to back), beside
  PostgreSQL's own `COPY` of the same rows (selected back from the table the API filled) into a
  table with the same columns and indexes that checks no references (the usage table checks
  its four once per statement, migration capacity 0035:
  `copy_events_per_s_with_the_usage_tables_reference_checks` prints what that costs COPY, and
  `copy_events_per_s_with_row_by_row_foreign_keys` what the foreign keys it had cost; the
  headline figure is printed against the COPY with the table's checks too), on the same
  machine. Figures: one worker against one COPY stream at
  batches of 5,000 (the target: at least half of COPY), 1,000 and 100 (the curve: what a
  request's own overhead costs), and two workers against two concurrent COPY streams. Each
  figure is the median of 3 rounds; in each round every setup runs once, then its COPY, so a
  slow spell of the shared machine hits figure and baseline alike.
- utilisation: p95 latency of the utilisation query (30 days, one step per day) over 30 days
  of minute rollups for 100 customers, beside one plain aggregate (count, sum, max) over the
  same rows: the least any query over them must pay.

`BENCH_USAGE_PROFILE=DIR` records each gunicorn worker with py-spy (`BENCH_PY_SPY`, default
`/tmp/pv/bin/py-spy`) into DIR as collapsed stacks.
"""

import json
import os
import signal
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
from capacity.pricing.features import mu_coefficients
from capacity.repricing.services import cost_model_record

ROOT = Path(__file__).resolve().parent.parent
# (workers, events per batch, batches per round): the headline, the two-worker figure, and the
# curve over batch sizes. Small batches pay a request's own overhead per 100 events, so they get
# fewer events to keep the run short.
SETUPS = ((1, 5_000, 6), (2, 5_000, 8), (1, 1_000, 12), (1, 100, 40))
ROUNDS = 3
TARGET_OF_COPY = 0.5  # issue 24, item 1: at least half of COPY's rate, per worker
CUSTOMERS = 100
DAYS = 30
UTILISATION_QUERIES = 40
CLIENTS_PER_WORKER = 4
THREADS_PER_WORKER = 4
WEIGHTS = {"input_tokens": 1e-4, "output_tokens": 2e-2, "output_sq_per_1000": 1e-3,
           "request": 5e-2}  # fmt: skip
COPY_COLUMNS = (
    "event_id, customer_id, served_model_id, deployment_id, started_at, finished_at, minute, "
    "input_tokens, cached_input_tokens, output_tokens, images, outcome, admission_class, "
    "verification, self_reported, ttft_ms, mu, cost_model_id, ingested_at, rolled_up"
)


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


def _bodies(customer_slug: str, prefix: str, batch: int, batches: int) -> list[bytes]:
    """`batches` JSON bodies of `batch` events each, ids starting with `prefix` (unique per
    setup and round, so no event is a duplicate)."""
    now = datetime.now(UTC) - timedelta(minutes=5)
    bodies = []
    for first in range(0, batch * batches, batch):
        events = []
        for index in range(first, first + batch):
            finished = now - timedelta(milliseconds=index * 7)
            events.append(
                {
                    "event_id": f"{prefix}-{index:09d}",
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
        bodies.append(json.dumps({"events": events}).encode())
    return bodies


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


class _Server:
    """gunicorn serving the control plane with `workers` worker processes."""

    def __init__(self, workers: int):
        self.workers = workers
        port = _free_port()
        env = os.environ | {"DATABASE_URL": _database_url(), "SECURE_SSL_REDIRECT": "0"}
        command = [sys.executable, "-m", "gunicorn", "controlplane.wsgi:application", "--bind",
                   f"127.0.0.1:{port}", "--workers", str(workers), "--threads",
                   str(THREADS_PER_WORKER), "--timeout", "300"]  # fmt: skip
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.profiler = None
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(self.url + "/healthz", timeout=1, trust_env=False).status_code == 200:
                    self._profile()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("gunicorn did not answer /healthz")

    def _profile(self) -> None:
        directory = os.environ.get("BENCH_USAGE_PROFILE")
        if directory:
            py_spy = os.environ.get("BENCH_PY_SPY", "/tmp/pv/bin/py-spy")
            self.profiler = subprocess.Popen(
                [py_spy, "record", "--pid", str(self.process.pid), "--subprocesses", "--format",
                 "raw", "-r", "250", "-o", f"{directory}/usage-{self.workers}w.raw"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            self.profiler.wait(timeout=60)
        self.process.terminate()
        self.process.wait(timeout=20)

    def ingest(self, bodies: list[bytes], key: str, batch: int) -> float:
        """Events/s of `bodies` posted by CLIENTS_PER_WORKER clients per worker."""
        clients = CLIENTS_PER_WORKER * self.workers
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        failures = []

        def send(share: list[bytes]) -> None:
            with httpx.Client(base_url=self.url, timeout=300, trust_env=False) as client:
                for body in share:
                    response = client.post("/api/v1/usage/events", content=body, headers=headers)
                    if response.status_code != 200 or response.json()["accepted_count"] != batch:
                        failures.append(response.text[:300])

        threads = [
            threading.Thread(target=send, args=(bodies[n::clients],)) for n in range(clients)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        if failures:
            raise AssertionError(f"ingestion failed: {failures[0]}")
        return len(bodies) * batch / seconds


def _copy_text(prefix: str) -> str:
    """The rows the API stored for `prefix`, as COPY's text format."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {COPY_COLUMNS} FROM capacity_usageevent WHERE event_id LIKE %s",  # noqa: S608
            [prefix + "-%"],
        )
        rows = cursor.fetchall()
    return "".join("\t".join("\\N" if v is None else str(v) for v in row) + "\n" for row in rows)


# What the usage table's references cost a COPY, by how they are checked: the four foreign
# keys it had until migration capacity 0035 (PostgreSQL checks each row's), or what replaced
# them there (one statement-level check over the statement's rows, the table's own function).
ROW_BY_ROW_KEYS = [
    "FOREIGN KEY (customer_id) REFERENCES accounts_customer(id) DEFERRABLE INITIALLY DEFERRED",
    "FOREIGN KEY (served_model_id) REFERENCES capacity_servedmodel(id) "
    "DEFERRABLE INITIALLY DEFERRED",
    "FOREIGN KEY (deployment_id) REFERENCES capacity_deployment(id) DEFERRABLE INITIALLY DEFERRED",
    "FOREIGN KEY (cost_model_id) REFERENCES capacity_costmodel(id) DEFERRABLE INITIALLY DEFERRED",
]
STATEMENT_CHECK = (
    "CREATE TRIGGER bench_copy_twin_references AFTER INSERT ON bench_copy_twin "
    "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
    "EXECUTE FUNCTION usage_event_references_check()"
)


def _copy_baseline(texts: list[str], *, references: str | None = None) -> float:
    """Rows/s of COPYing each text in its own concurrent stream (connection) into a fresh twin
    table with the same columns and indexes; `references` "keys": with the row-by-row foreign
    keys the usage table had, "checks": with the statement-level check it has now."""
    import psycopg

    url = _database_url()
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS bench_copy_twin")
        cursor.execute("CREATE TABLE bench_copy_twin (LIKE capacity_usageevent INCLUDING ALL)")
        if references == "keys":
            for definition in ROW_BY_ROW_KEYS:
                cursor.execute(f"ALTER TABLE bench_copy_twin ADD {definition}")
        elif references == "checks":
            cursor.execute(STATEMENT_CHECK)
    streams = [psycopg.connect(url, autocommit=False) for _ in texts]
    ready = threading.Barrier(len(texts) + 1)

    def copy(stream, text: str) -> None:
        ready.wait()
        with stream.cursor().copy(f"COPY bench_copy_twin ({COPY_COLUMNS}) FROM STDIN") as out:
            out.write(text)
        stream.commit()

    threads = [
        threading.Thread(target=copy, args=pair) for pair in zip(streams, texts, strict=True)
    ]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    for stream in streams:
        stream.close()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM bench_copy_twin")
        copied = cursor.fetchone()[0]
        cursor.execute("DROP TABLE bench_copy_twin")
    assert copied == sum(text.count("\n") for text in texts)
    return copied / seconds


def _ingestion_figures(customer_slug: str, key: str) -> list[Figure]:
    servers = {workers: _Server(workers) for workers in sorted({s[0] for s in SETUPS})}
    api: dict[tuple, list[float]] = {setup: [] for setup in SETUPS}
    copy: dict[tuple, list[float]] = {setup: [] for setup in SETUPS}
    copy_with_keys: list[float] = []
    copy_with_checks: list[float] = []
    try:
        for round_number in range(ROUNDS):
            for setup in SETUPS:
                workers, batch, batches = setup
                prefix = f"r{round_number}-w{workers}-b{batch}"
                bodies = _bodies(customer_slug, prefix, batch, batches)
                api[setup].append(servers[workers].ingest(bodies, key, batch))
                text = _copy_text(prefix)
                # One COPY stream per worker, each with its share of the rows.
                lines = text.splitlines(keepends=True)
                texts = ["".join(lines[n::workers]) for n in range(workers)]
                copy[setup].append(_copy_baseline(texts))
                if setup == SETUPS[0]:
                    copy_with_keys.append(_copy_baseline(texts, references="keys"))
                    copy_with_checks.append(_copy_baseline(texts, references="checks"))
    finally:
        for server in servers.values():
            server.stop()
    figures = []
    for setup in SETUPS:
        workers, batch, _ = setup
        streams = "one COPY stream" if workers == 1 else f"{workers} concurrent COPY streams"
        figures.append(
            Figure(
                name=f"ingest_events_per_s_http_{workers}w_batch{batch}",
                value=statistics.median(api[setup]),
                unit="events/s",
                baseline=statistics.median(copy[setup]),
                baseline_name=f"PostgreSQL COPY of the same rows, {streams}",
                target_ratio=TARGET_OF_COPY,
            )
        )
    # The baseline's twin has the table's columns and indexes but checks no references. What
    # checking them costs COPY itself: row by row (the foreign keys the table had) and once per
    # statement (what it has), and the headline figure against a COPY that checks them as the
    # table does (for information: the target is on the above).
    headline = SETUPS[0]
    figures += [
        Figure(
            name=f"copy_events_per_s_with_{checked}",
            value=statistics.median(rates),
            unit="events/s",
            baseline=statistics.median(copy[headline]),
            baseline_name="the same COPY into a twin that checks no references",
        )
        for checked, rates in (
            ("row_by_row_foreign_keys", copy_with_keys),
            ("the_usage_tables_reference_checks", copy_with_checks),
        )
    ]
    figures.append(
        Figure(
            name=f"ingest_events_per_s_http_{headline[0]}w_batch{headline[1]}_vs_copy_with_checks",
            value=statistics.median(api[headline]),
            unit="events/s",
            baseline=statistics.median(copy_with_checks),
            baseline_name="PostgreSQL COPY of the same rows, checking references as the table does",
        )
    )
    return figures


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
    ingestion = _ingestion_figures(customer.slug, key.plaintext)

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
        *ingestion,
        Figure(
            name="utilisation_query_p95_30d",
            value=p95(query_ms),
            unit="ms",
            baseline=p95(fetch_ms),
            baseline_name="one sum over the same 43,200 rollup rows",
        ),
    ]

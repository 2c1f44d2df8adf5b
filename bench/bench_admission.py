"""Admission decisions: the in-process API and the HTTP endpoint, each beside its floor.

- inprocess_decisions_per_s: `capacity.admission.gate.admit` in a loop, one client process, one
  connection, no pipelining, against `redis-benchmark` with the same connection count and
  pipelining depth on the same machine, running EVALSHA of
  - the admission script itself, with the keys and arguments of the same decision: what a C
    client gets with Redis doing the same work (14.5 µs a decision, INFO commandstats), so the
    ratio is our client's own cost. Target (issue 24): at least 60 % of it;
  - a trivial script (`return 1`): the rate one connection to Redis allows at all, kept for
    continuity with the first figures (0.48-0.50x); against it the ratio also carries the
    script's work in Redis.
  Three rounds, redis-benchmark and ours taking turns, each figure the median of the three.
  Its p50 and p99 latencies are reported beside redis-benchmark's (same script).
- http_decisions_per_s: POST /api/v1/admission with a Bearer key through the Django stack
  (in process, as bench_api_auth), beside an endpoint mounted on the same stack with the same
  authentication that returns a constant. Target: at least 50 % of its throughput.
- request_limits_decisions_per_s (issue 22): `admit` for a customer whose customer-wide and
  per-key RPM, TPM and concurrency limits are all on (set far above the load, so every
  decision admits and every limit's log and in-flight set is written), beside MU-only `admit`
  (a customer without request limits) in the same run, round by round. Both are one round
  trip; what the ratio shows is the script's extra work (two scopes' limits read, their logs
  pruned and appended, the slots taken).
"""

import csv
import io
import statistics
import subprocess
import time
from urllib.parse import urlparse

import redis
from django.conf import settings
from django.test import override_settings
from django.urls import include, path
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.services import api_key_create, customer_create
from bench.figures import Figure
from bench.timing import median_latencies
from capacity.admission import gate as admission
from capacity.admission.bucket import Floor
from capacity.admission.limits import request_limit_set
from capacity.admission.redis_layout import admit_keys_and_args
from capacity.allocation.policy import Allowance
from capacity.models import GpuType, ServedModel
from capacity.pricing.features import mu_coefficients
from capacity.publication.publish import publish_gateway_state
from capacity.repricing.services import cost_model_record

DECISIONS = 20_000
ROUNDS = 3  # redis-benchmark and our decisions take turns; each figure is their median
TRIVIAL_SCRIPT = "return 1"
WEIGHTS = {"input_tokens": 1e-4, "output_tokens": 2e-3, "request": 0.01}


class ConstantView(APIView):
    """The same authentication and DRF stack as the admission view; answers a constant."""

    def post(self, request):
        return Response({"admitted": True})


urlpatterns = [
    path("bench/constant", ConstantView.as_view()),
    path("", include(settings.ROOT_URLCONF)),
]


def _fixture():
    gpu = GpuType.objects.create(name="bench-h100", memory_gb=80, hourly_cost_usd=4)
    model = ServedModel.objects.create(
        name="bench-admission",
        parameters_billions=8,
        context_length_tokens=8192,
        reference_gpu_type=gpu,
    )
    cost_model_record(
        served_model=model,
        gpu_type=gpu,
        gpus_per_replica=1,
        features=list(WEIGHTS),
        weights_replica_seconds=WEIGHTS,
        mu_per_unit=mu_coefficients(WEIGHTS),
        sample_count=10,
        distinct_shapes=10,
        cv_mape=0.01,
        cv_worst_error=0.02,
        candidates=[],
        residuals=[],
    )
    customer = customer_create(name="Bench admission", slug="bench-admission")
    plaintext = api_key_create(name="gateway", customer=customer, scopes=[S.ADMISSION]).plaintext
    # Limits far above the load: every decision admits, the common case.
    _far_above_the_load(customer, model)
    return customer, model, plaintext


def _far_above_the_load(customer, model) -> None:
    """A reservation floor and a best-effort allowance far above the load (the floor as a sale
    writes it, the allowance as the tick publishes it, with its heartbeat)."""
    admission.publish_limits([Allowance(customer.pk, model.pk, 1e9, 1e9)])
    pair = (customer.pk, model.pk)
    admission.buckets().publish_floors({pair: Floor(1e9)}, pairs=[pair])


def _admission_command(customer, model) -> list[str]:
    """EVALSHA of the admission script as `admit` sends it for the benchmark's decision."""
    buckets = admission.buckets()
    keys, args = admit_keys_and_args(buckets, customer.pk, model.pk, 1.0, None, 600, None)
    buckets.client.script_load(buckets._admit.script)
    return ["EVALSHA", buckets._admit.sha, str(len(keys)), *keys, *(str(a) for a in args)]


def _trivial_command() -> list[str]:
    sha = redis.Redis.from_url(settings.ADMISSION_REDIS_URL).script_load(TRIVIAL_SCRIPT)
    return ["EVALSHA", sha, "0"]


def _redis_benchmark(command: list[str]) -> dict:
    url = urlparse(settings.ADMISSION_REDIS_URL)
    output = subprocess.run(
        ["redis-benchmark", "-h", url.hostname or "127.0.0.1", "-p", str(url.port or 6379),
         "--dbnum", url.path.strip("/") or "0",
         "-c", "1", "-P", "1", "-n", str(DECISIONS), "--csv", *command],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    row = list(csv.DictReader(io.StringIO(output)))[-1]
    return {
        "rps": float(row["rps"]),
        "p50_ms": float(row["p50_latency_ms"]),
        "p99_ms": float(row["p99_latency_ms"]),
    }


def _in_process(customer, model) -> dict:
    def decide():
        return admission.admit(
            customer_id=customer.pk,
            model=model.name,
            input_tokens=500,
            max_tokens=100,
            request_id=None,
        )

    for _ in range(500):
        decide()
    latencies = []
    started = time.perf_counter()
    for _ in range(DECISIONS):
        t0 = time.perf_counter()
        decision = decide()
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    if not decision.admitted or decision.degraded:
        raise AssertionError(f"the benchmark's decisions must be admitted: {decision}")
    latencies.sort()
    return {
        "rps": DECISIONS / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


def _http(plaintext, model) -> dict:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    body = {"model": model.name, "input_tokens": 500, "max_tokens": 100}

    def post(path):
        def call():
            response = client.post(path, body, format="json")
            if response.status_code != 200:
                raise AssertionError(f"POST {path}: {response.status_code} {response.content}")

        return call

    with override_settings(ROOT_URLCONF=__name__):
        seconds = median_latencies(
            {"constant": post("/bench/constant"), "admission": post("/api/v1/admission")},
            iterations=200,
            rounds=5,
        )
    return {name: 1.0 / value for name, value in seconds.items()}


def _limited_customer(model):
    """A customer under every request limit, customer-wide and on its key, far above the load."""
    customer = customer_create(name="Bench limits", slug="bench-admission-limits")
    key = api_key_create(name="limited", customer=customer, scopes=[S.ADMISSION]).api_key
    huge = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "concurrent_requests": 10**9}
    request_limit_set(customer=customer, **huge)
    request_limit_set(customer=customer, api_key=key, **huge)
    _far_above_the_load(customer, model)
    publish_gateway_state(reason="bench")
    return customer, key


def _request_limits(customer, model, limited, key) -> dict:
    def decide(customer_id, prefix):
        def call():
            decision = admission.admit(
                customer_id=customer_id, model=model.name, input_tokens=500, max_tokens=100,
                request_id=None, api_key_prefix=prefix,
            )  # fmt: skip
            if not decision.admitted or decision.degraded:
                raise AssertionError(f"the benchmark's decisions must be admitted: {decision}")

        return call

    seconds = median_latencies(
        {
            "mu_only": decide(customer.pk, None),
            "with_limits": decide(limited.pk, key.prefix),
        },
        iterations=1000,
        rounds=5,
        warmup=200,
    )
    return {name: 1.0 / value for name, value in seconds.items()}


def run() -> list[Figure]:
    customer, model, plaintext = _fixture()
    limited, key = _limited_customer(model)
    same_script, trivial = _admission_command(customer, model), _trivial_command()
    rounds = [
        {
            "same_script": _redis_benchmark(same_script),
            "trivial": _redis_benchmark(trivial),
            "ours": _in_process(customer, model),
        }
        for _ in range(ROUNDS)
    ]

    def median(which: str, name: str) -> float:
        return statistics.median(r[which][name] for r in rounds)

    http = _http(plaintext, model)
    limits = _request_limits(customer, model, limited, key)
    how = f"1 connection, no pipelining; median of {ROUNDS}"
    what = f"redis-benchmark EVALSHA of the same admission script and decision, {how}"
    return [
        Figure(
            "inprocess_decisions_per_s",
            median("ours", "rps"),
            "decisions/s",
            median("same_script", "rps"),
            what,
            target_ratio=0.6,
        ),
        Figure(
            "inprocess_decisions_per_s_vs_trivial",
            median("ours", "rps"),
            "decisions/s",
            median("trivial", "rps"),
            f"redis-benchmark EVALSHA 'return 1', {how}",
        ),
        Figure(
            "inprocess_p50_latency",
            median("ours", "p50_ms"),
            "ms",
            median("same_script", "p50_ms"),
            what,
        ),
        Figure(
            "inprocess_p99_latency",
            median("ours", "p99_ms"),
            "ms",
            median("same_script", "p99_ms"),
            what,
        ),
        Figure(
            "http_decisions_per_s",
            http["admission"],
            "requests/s",
            http["constant"],
            "constant endpoint, same server and authentication",
        ),
        Figure(
            "request_limits_decisions_per_s",
            limits["with_limits"],
            "decisions/s",
            limits["mu_only"],
            "MU-only admit (no request limits), in process, interleaved",
        ),
    ]

"""Writes for benchmark suites and runs, imports, and fits.

A run is a row (docs/design.md#tasks): the task claims it by a conditional update, reports progress
and a heartbeat on the row while it works, and ends it as succeeded or failed. The heartbeat
beats every sixth of BENCHMARK_STALE_AFTER_SECONDS from the runner's event loop, during a
point too (a point may last an hour), so only a worker that really stopped goes silent. A run
whose worker died is failed by `runs_reap_stale`, so no run stays "running" forever, and a fit
only ever reads a succeeded run.
"""

import asyncio
import logging
from collections.abc import Sequence
from contextlib import suppress
from datetime import timedelta

from asgiref.sync import async_to_sync, sync_to_async
from celery import current_app
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from benchmarking import fitting, importers, isolation, runner
from benchmarking.models import BenchmarkRun, BenchmarkSample, BenchmarkSuite
from benchmarking.references import cost_model_source_set
from capacity.metering.events import MAX_TOKENS
from capacity.models import CostModel, Deployment, GpuType, ServedModel
from capacity.pricing.features import REPLICA_MU_PER_MINUTE, Shape, mu_coefficients
from capacity.repricing.services import cost_model_record
from core import outbound
from core.errors import ConflictError, DomainError

logger = logging.getLogger(__name__)

MAX_LOG_CHARS = 20_000


# --- Suites --------------------------------------------------------------------------------


GRID_SHAPE_KEYS = ("input_len", "output_len", "prefix_share", "images")
MAX_IMAGES_PER_REQUEST = 64


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_TOKENS


def _grid_shape(index: int, shape) -> list[int] | dict:
    """[input_len, output_len] as it is; an object with a prefix share or images in full."""
    if isinstance(shape, list | tuple):
        if len(shape) == 2 and all(_positive_int(v) for v in shape):
            return [int(shape[0]), int(shape[1])]
        raise DomainError(
            f"grid[{index}] must be [input_len, output_len], two positive integers up to "
            f"{MAX_TOKENS}; got {shape!r}.",
            field="grid",
        )
    if not isinstance(shape, dict):
        raise DomainError(
            f"grid[{index}] must be [input_len, output_len] or an object with "
            f"{', '.join(GRID_SHAPE_KEYS)}; got {shape!r}.",
            field="grid",
        )
    unknown = sorted(set(shape) - set(GRID_SHAPE_KEYS))
    if unknown:
        raise DomainError(
            f"grid[{index}].{unknown[0]} is not a shape field (known: "
            f"{', '.join(GRID_SHAPE_KEYS)}).",
            field="grid",
        )
    for key in ("input_len", "output_len"):
        if not _positive_int(shape.get(key)):
            raise DomainError(
                f"grid[{index}].{key} must be a positive integer up to {MAX_TOKENS}; got "
                f"{shape.get(key)!r}.",
                field="grid",
            )
    share = shape.get("prefix_share", 0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < 1:
        raise DomainError(
            f"grid[{index}].prefix_share must be a number from 0 up to (not including) 1: the "
            f"share of the prompt every request of the shape shares; got {share!r}.",
            field="grid",
        )
    images = shape.get("images", 0)
    if (
        isinstance(images, bool)
        or not isinstance(images, int)
        or not 0 <= images <= MAX_IMAGES_PER_REQUEST
    ):
        raise DomainError(
            f"grid[{index}].images must be an integer from 0 to {MAX_IMAGES_PER_REQUEST}; "
            f"got {images!r}.",
            field="grid",
        )
    if not share and not images:
        return [int(shape["input_len"]), int(shape["output_len"])]
    return {
        "input_len": int(shape["input_len"]),
        "output_len": int(shape["output_len"]),
        "prefix_share": float(share),
        "images": int(images),
    }


def grid_shapes(grid) -> tuple[runner.GridShape, ...]:
    """A stored (validated) grid as the runner's shapes."""
    return tuple(
        runner.GridShape(int(shape[0]), int(shape[1]))
        if isinstance(shape, list)
        else runner.GridShape(**shape)
        for shape in grid
    )


def validate_grid(grid) -> list:
    """A suite's grid as it is stored: every shape checked (a bad one named by its index), none
    repeated."""
    if not isinstance(grid, list) or not grid:
        raise DomainError("grid must be a non-empty list of [input_len, output_len].", field="grid")
    shapes = [_grid_shape(index, shape) for index, shape in enumerate(grid)]
    if len(set(grid_shapes(shapes))) != len(shapes):
        raise DomainError("grid repeats a shape.", field="grid")
    return shapes


@transaction.atomic
def suite_create(**values) -> BenchmarkSuite:
    """Create a suite from its fields, its grid validated; its name is unique."""
    values["grid"] = validate_grid(values.get("grid"))
    if BenchmarkSuite.objects.filter(name=values["name"]).exists():
        raise ConflictError(f"A suite named '{values['name']}' already exists.", field="name")
    if values.get("max_concurrency", 256) < values.get("concurrency_start", 1):
        raise DomainError(
            "max_concurrency must be at least concurrency_start.", field="max_concurrency"
        )
    return BenchmarkSuite.objects.create(**values)


# --- Queuing and executing runs --------------------------------------------------------------


# A run of a deployment whose replicas cannot be told apart, measured at its endpoint.
SHARED_ENDPOINT = "shared endpoint"


# The task that executes a queued run, registered under this name by benchmarking.tasks, and
# its queue. Queued by name: the tasks call these services, never the reverse.
RUN_TASK = "benchmarking.run_benchmark"
RUN_QUEUE = "benchmarks"


def _queue_task(run_id: int) -> None:
    current_app.send_task(RUN_TASK, args=[run_id], queue=RUN_QUEUE)


@transaction.atomic
def run_queue(
    *,
    suite: BenchmarkSuite,
    deployment: Deployment | None = None,
    endpoint_url: str = "",
    served_model: ServedModel | None = None,
    gpu_type: GpuType | None = None,
    gpus_per_replica: int | None = None,
    replicas: int = 1,
) -> BenchmarkRun:
    """Queue a benchmark of a deployment's endpoint (or of an explicit endpoint)."""
    # A deployment whose replicas can be told apart (the process supervisor, Kubernetes pods
    # by selector) is measured on replicas held for the run, out of the customers' rotation
    # (benchmarking/isolation.py). One that cannot (a webhook, a dry run: one endpoint) is
    # measured at its endpoint as before, recorded as not isolated, and its fit never
    # activates by itself. An explicit endpoint is the planner's own choice.
    isolated = False
    shared = ""
    if deployment is not None:
        deployment = Deployment.objects.select_related("served_model", "gpu_pool__gpu_type").get(
            pk=deployment.pk
        )
        served_model = served_model or deployment.served_model
        gpu_type = gpu_type or deployment.gpu_pool.gpu_type
        gpus_per_replica = gpus_per_replica or deployment.gpus_per_replica
        isolated = not endpoint_url and not isolation.isolation_refusal(deployment)
        if not isolated and not endpoint_url:
            endpoint_url = deployment.endpoint_url
            shared = f"{SHARED_ENDPOINT}: {isolation.isolation_refusal(deployment)}"[:500]
    if not endpoint_url and not isolated:
        raise DomainError(
            "Nothing to benchmark: the deployment has no endpoint_url; give one.",
            field="endpoint_url",
        )
    if endpoint_url:
        # Load goes only where the operator allows: refused here with the rule, and again by
        # the runner's clients on the address they connect to.
        outbound.check_url(endpoint_url, purpose=outbound.BENCHMARK, field="endpoint_url")
    if served_model is None or gpu_type is None:
        raise DomainError("Give a deployment, or a model and a GPU type.", field="deployment")
    if replicas < 1:
        raise DomainError("replicas must be at least 1.", field="replicas")
    run = BenchmarkRun.objects.create(
        suite=suite,
        deployment=deployment,
        served_model=served_model,
        gpu_type=gpu_type,
        gpus_per_replica=gpus_per_replica or 1,
        replicas=replicas,
        endpoint_url=endpoint_url,
        isolated=isolated,
        engine_model_id=served_model.engine_model_id,
        source=BenchmarkRun.Source.RUNNER,
        source_detail=shared,
        progress_total=len(suite.grid),
        progress_message="queued",
    )
    run_id = run.pk
    transaction.on_commit(lambda: _queue_task(run_id))
    return run


def run_claim(*, run_id: int) -> bool:
    """Take a queued run. False when another worker has it or it has ended."""
    now = timezone.now()
    claimed = BenchmarkRun.objects.filter(pk=run_id, status=BenchmarkRun.Status.QUEUED).update(
        status=BenchmarkRun.Status.RUNNING,
        started_at=now,
        heartbeat_at=now,
        progress_message="starting",
    )
    if claimed:
        BenchmarkRun.objects.filter(pk=run_id).update(attempts=F("attempts") + 1)
    return bool(claimed)


def _append_log(run_id: int, line: str) -> None:
    run = BenchmarkRun.objects.only("log").get(pk=run_id)
    stamped = f"{timezone.now():%Y-%m-%d %H:%M:%S} {line}\n"
    log = (run.log + stamped)[-MAX_LOG_CHARS:]
    BenchmarkRun.objects.filter(pk=run_id).update(log=log)


def _still_running(run_id: int) -> bool:
    return BenchmarkRun.objects.filter(pk=run_id, status=BenchmarkRun.Status.RUNNING).exists()


def _record_point(run_id: int, replicas: int, point: runner.PointResult) -> None:
    if not _still_running(run_id):
        # The reaper failed this run (or a planner did); stop writing into it.
        raise runner.RunnerError("the run was ended while it was measuring")
    BenchmarkSample.objects.create(
        run_id=run_id,
        # As the engines counted and served them: prompt tokens (images' included), the part
        # their prefix caches served (read back from their counters), images per request.
        input_len=point.measured_input_tokens,
        cached_input_len=point.cached_input_tokens,
        images=point.images,
        output_len=point.output_len,
        concurrency=point.concurrency,
        requests_per_s=point.requests_per_s / replicas,
        input_tokens_per_s=point.input_tokens_per_s / replicas,
        output_tokens_per_s=point.output_tokens_per_s / replicas,
        ttft_p50_ms=point.ttft_p50_ms,
        ttft_p95_ms=point.ttft_p95_ms,
        tpot_p50_ms=point.tpot_p50_ms,
        tpot_p95_ms=point.tpot_p95_ms,
        e2e_p95_ms=point.e2e_p95_ms,
        request_count=point.request_count,
        error_count=point.error_count,
        slo_met=point.slo_met,
        client_ttft_mean_ms=point.client_ttft_mean_ms,
        engine_ttft_mean_ms=point.engine_ttft_mean_ms,
        client_lag_mean_ms=point.client_lag_mean_ms,
    )
    BenchmarkRun.objects.filter(pk=run_id).update(
        heartbeat_at=timezone.now(),
        progress_message=(
            f"{_described(point)} at concurrency {point.concurrency}: "
            f"{point.requests_per_s:.3g} req/s, p95 TTFT {point.ttft_p95_ms or 0:.0f} ms, "
            f"p95 TPOT {point.tpot_p95_ms or 0:.1f} ms"
        ),
    )


def _described(point: runner.PointResult | runner.ShapeResult) -> str:
    return runner.GridShape(
        point.input_len, point.output_len, point.prefix_share, point.images
    ).describe()


def _record_shape(run_id: int, shape: runner.ShapeResult) -> None:
    if shape.sustainable is not None:
        point = shape.sustainable
        BenchmarkSample.objects.filter(
            run_id=run_id,
            input_len=point.measured_input_tokens,
            cached_input_len=point.cached_input_tokens,
            images=point.images,
            output_len=point.output_len,
            concurrency=point.concurrency,
        ).update(sustainable=True)
    BenchmarkRun.objects.filter(pk=run_id).update(
        progress_done=F("progress_done") + 1, heartbeat_at=timezone.now()
    )
    verdict = (
        f"sustainable {shape.sustainable.requests_per_s:.3g} req/s at concurrency "
        f"{shape.sustainable.concurrency}"
        if shape.sustainable
        else "no concurrency met the SLO"
    )
    if shape.sustainable is not None and shape.sustainable.cache_hit_share is not None:
        verdict += f", prefix-cache hits {shape.sustainable.cache_hit_share:.0%} of the prompt"
    _append_log(run_id, f"{_described(shape)}: {verdict} ({shape.stop_reason})")


def _heartbeat(run_id: int) -> bool:
    """Beat; False when the run is no longer running (the reaper or a planner ended it)."""
    return bool(
        BenchmarkRun.objects.filter(pk=run_id, status=BenchmarkRun.Status.RUNNING).update(
            heartbeat_at=timezone.now()
        )
    )


def heartbeat_interval_seconds() -> float:
    """How often a running run beats: a sixth of BENCHMARK_STALE_AFTER_SECONDS."""
    return settings.BENCHMARK_STALE_AFTER_SECONDS / 6


async def _with_heartbeat(run_id: int, measuring) -> list:
    """Await `measuring` (the runner's grid) while beating the run's heartbeat; when the run is
    ended meanwhile, stop measuring at once rather than at the end of the point."""
    beat = sync_to_async(_heartbeat, thread_sensitive=True)
    task = asyncio.ensure_future(measuring)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=heartbeat_interval_seconds())
            if done:
                return task.result()
            if not await beat(run_id):
                raise runner.RunnerError("the run was ended while it was measuring")
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task


def run_fail(*, run_id: int, error: str) -> bool:
    """End a queued or running run as failed, with the reason; False when it had ended."""
    ended = BenchmarkRun.objects.filter(
        pk=run_id, status__in=[BenchmarkRun.Status.QUEUED, BenchmarkRun.Status.RUNNING]
    ).update(status=BenchmarkRun.Status.FAILED, error=error[:5000], finished_at=timezone.now())
    if ended:
        _append_log(run_id, f"failed: {error[:500]}")
    return bool(ended)


def run_execute(*, run_id: int) -> BenchmarkRun | None:
    """Claim a queued run, measure its grid, then fit. Returns None when not claimed."""
    if not run_claim(run_id=run_id):
        logger.info("benchmark run %s was not queued; nothing to do", run_id)
        return None
    run = BenchmarkRun.objects.select_related("suite", "deployment").get(pk=run_id)
    assert run.suite is not None  # a queued run measures a suite (run_queue)
    spec = _suite_spec(run.suite)
    try:
        _measure_run(run, spec)
    except (runner.RunnerError, isolation.IsolationError, DomainError) as error:
        run_fail(run_id=run_id, error=str(getattr(error, "message", error)))
        return BenchmarkRun.objects.get(pk=run_id)
    _judge_client_overhead(run_id)
    _run_succeed(run_id)
    return BenchmarkRun.objects.get(pk=run_id)


def _suite_spec(suite: BenchmarkSuite) -> runner.SuiteSpec:
    """A stored suite as the runner takes it."""
    return runner.SuiteSpec(
        grid=grid_shapes(suite.grid),
        slo_ttft_p95_ms=suite.slo_ttft_p95_ms,
        slo_tpot_p95_ms=suite.slo_tpot_p95_ms,
        duration_per_point_seconds=suite.duration_per_point_seconds,
        concurrency_start=suite.concurrency_start,
        max_concurrency=suite.max_concurrency,
        min_throughput_growth=suite.min_throughput_growth,
        max_error_rate=suite.max_error_rate,
        request_timeout_seconds=suite.request_timeout_seconds,
    )


def _measure_run(run: BenchmarkRun, spec: runner.SuiteSpec) -> None:
    """Measure the run's grid on the replicas held for it, out of the customers' rotation,
    when it is isolated; else at its endpoint."""
    run_id = run.pk
    if run.isolated and run.deployment is not None:
        deployment = run.deployment
        with isolation.held_replicas(
            run_id=run_id,
            deployment=deployment,
            replicas=run.replicas,
            wait_seconds=deployment.cold_start_seconds + settings.BENCHMARK_REPLICA_WAIT_SECONDS,
            progress=lambda message: _progress(run_id, message),
            beat=lambda: _heartbeat(run_id),
        ) as urls:
            BenchmarkRun.objects.filter(pk=run_id).update(measured_endpoints=urls)
            _append_log(
                run_id,
                f"benchmarking {run.engine_model_id} on {len(urls)} replica(s) held for "
                f"the run, out of the customers' rotation: {', '.join(urls)}",
            )
            _measure_grid(run, spec, urls)
    else:
        shared = (
            f" (shared with customers' traffic: {isolation.isolation_refusal(run.deployment)})"
            if run.deployment is not None
            else ""
        )
        _append_log(run_id, f"benchmarking {run.engine_model_id} at {run.endpoint_url}{shared}")
        _measure_grid(run, spec, [run.endpoint_url])


def _measure_grid(run: BenchmarkRun, spec: runner.SuiteSpec, base_urls: list[str]) -> None:
    """The runner's grid against `base_urls`, each point and shape recorded as it ends, while
    the run's heartbeat beats."""
    run_id = run.pk
    record_point = sync_to_async(_record_point, thread_sensitive=True)
    record_shape = sync_to_async(_record_shape, thread_sensitive=True)

    async def on_point(point):
        await record_point(run_id, run.replicas, point)

    async def on_shape(shape):
        await record_shape(run_id, shape)

    # async_to_sync runs the loop in a side thread and brings sync_to_async callbacks back
    # to this thread, so progress is written on this thread's database connection.
    async_to_sync(_with_heartbeat)(
        run_id,
        runner.run_grid(
            base_url=base_urls,
            model=run.engine_model_id,
            spec=spec,
            host_policy=outbound.policy(outbound.BENCHMARK),
            processes=settings.BENCHMARK_CLIENT_PROCESSES,
            on_point=on_point,
            on_shape=on_shape,
        ),
    )


def _run_succeed(run_id: int) -> None:
    """The run turns succeeded and its fit lands in one transaction, so nobody sees a
    succeeded run whose cost model is still missing. A run whose client overhead was over the
    limit (`_judge_client_overhead`) measured its own client: it is not fitted."""
    with transaction.atomic():
        finished = BenchmarkRun.objects.filter(
            pk=run_id, status=BenchmarkRun.Status.RUNNING
        ).update(
            status=BenchmarkRun.Status.SUCCEEDED,
            finished_at=timezone.now(),
            heartbeat_at=timezone.now(),
            progress_message="measured every shape",
        )
        if not finished:
            return
        _append_log(run_id, "succeeded")
        judged = BenchmarkRun.objects.get(pk=run_id)
        if judged.reliable is False:
            reason = (
                f"not fitted: the client added {judged.client_overhead_ms:.1f} ms "
                f"({judged.client_overhead_share:.0%}) to the TTFT it measured, over the "
                f"{settings.BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT} % limit: the run measured "
                "its own client"
            )
            BenchmarkRun.objects.filter(pk=run_id).update(fit_error=reason)
            _append_log(run_id, reason)
            return
        _fit_run(run_id)


def _fit_run(run_id: int) -> None:
    """A new cost-model version from the run; why none could be fitted, on the run."""
    try:
        with transaction.atomic():
            cost_model = cost_model_fit(run=BenchmarkRun.objects.get(pk=run_id))
        _append_log(
            run_id,
            f"fitted v{cost_model.version}: CV MAPE {cost_model.cv_mape:.1%}, {cost_model.status}",
        )
    except DomainError as error:
        BenchmarkRun.objects.filter(pk=run_id).update(fit_error=error.message)
        _append_log(run_id, f"no fit: {error.message}")


def _progress(run_id: int, message: str) -> None:
    BenchmarkRun.objects.filter(pk=run_id).update(
        progress_message=message[:500], heartbeat_at=timezone.now()
    )


def _judge_client_overhead(run_id: int) -> None:
    """The run's worst client overhead (its event loop's lag) over its sustainable points,
    and whether it stays within BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT of the TTFT measured."""
    worst_ms = worst_share = None
    for lag_ms, ttft_ms in BenchmarkSample.objects.filter(
        run_id=run_id,
        sustainable=True,
        client_lag_mean_ms__isnull=False,
        client_ttft_mean_ms__isnull=False,
    ).values_list("client_lag_mean_ms", "client_ttft_mean_ms"):
        served_ms = ttft_ms - lag_ms
        share = lag_ms / served_ms if served_ms > 0 else float("inf")
        if worst_share is None or share > worst_share:
            worst_ms, worst_share = lag_ms, share
    if worst_share is None:
        return
    limit = settings.BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT / 100
    BenchmarkRun.objects.filter(pk=run_id).update(
        client_overhead_ms=worst_ms,
        client_overhead_share=min(worst_share, 1e6),
        reliable=worst_share <= limit,
    )
    _append_log(
        run_id,
        f"client overhead: {worst_ms:.2f} ms, {worst_share:.1%} of the TTFT measured "
        f"(limit {limit:.0%})",
    )


def runs_reap_stale(*, stale_after_seconds: int | None = None) -> list[int]:
    """Fail running runs whose worker stopped reporting (killed, lost, out of memory)."""
    seconds = stale_after_seconds or settings.BENCHMARK_STALE_AFTER_SECONDS
    cutoff = timezone.now() - timedelta(seconds=seconds)
    stale_ids = list(
        BenchmarkRun.objects.filter(
            status=BenchmarkRun.Status.RUNNING, heartbeat_at__lt=cutoff
        ).values_list("pk", flat=True)
    )
    reaped = []
    for run_id in stale_ids:
        if run_fail(
            run_id=run_id,
            error=f"The worker stopped reporting for over {seconds} s (killed or lost); "
            "partial samples are kept for inspection but are never fitted.",
        ):
            reaped.append(run_id)
            run = BenchmarkRun.objects.get(pk=run_id)
            if run.isolated and run.deployment_id is not None:
                # Its worker died holding replicas: give them back to the customers.
                isolation.release(
                    run_id=run_id, deployment_id=run.deployment_id, replicas=run.replicas
                )
    return reaped


# --- Imports ---------------------------------------------------------------------------------


@transaction.atomic
def benchmark_import(
    *,
    model_name: str,
    gpu_name: str,
    csv_text: str | None = None,
    files: Sequence[tuple[str, str]] | None = None,
    file_format: str = importers.AUTO,
    gpus_per_replica: int | None = None,
    replicas: int = 1,
    source_detail: str = "",
    gpu_memory_gb: int = 80,
    gpu_hourly_cost_usd=0,
    engine_model_id: str = "",
) -> tuple[BenchmarkRun, list[str]]:
    """Store imported benchmark results as a succeeded run. Returns the run and what was
    created along the way (a served model, a GPU type), so the caller can say so.

    `csv_text` is the project's own table (per replica already); `files` are (name, text)
    pairs of one tool's result files (`benchmarking.importers`), whose throughput is the whole
    endpoint's and is divided by `replicas`. `gpus_per_replica` defaults to what the files say
    (a trtllm-bench report's world size), else 1. Every file is read before anything is
    written, so a bad one writes nothing."""
    results, gpus_per_replica = _imported_results(
        csv_text=csv_text,
        files=files,
        file_format=file_format,
        gpus_per_replica=gpus_per_replica,
        replicas=replicas,
    )
    created: list[str] = []
    gpu_type = GpuType.objects.filter(name=gpu_name).first()
    if gpu_type is None:
        gpu_type = GpuType.objects.create(
            name=gpu_name, memory_gb=gpu_memory_gb, hourly_cost_usd=gpu_hourly_cost_usd
        )
        created.append(f"GPU type '{gpu_name}' ({gpu_memory_gb} GB, ${gpu_hourly_cost_usd}/h)")
    served_model = ServedModel.objects.filter(name=model_name).first()
    if served_model is None:
        context = max(sample.input_len + sample.output_len for sample in results.samples)
        served_model = ServedModel.objects.create(
            name=model_name,
            engine_model_id=engine_model_id or results.engine_model_id or model_name,
            parameters_billions=0,
            reference_gpu_type=gpu_type,
            context_length_tokens=context,
        )
        created.append(
            f"served model '{model_name}' (reference GPU {gpu_name}, context {context} tokens)"
        )
    run = _imported_run(
        results,
        served_model=served_model,
        gpu_type=gpu_type,
        gpus_per_replica=gpus_per_replica,
        replicas=replicas,
        source_detail=source_detail,
    )
    _imported_samples(run, results, replicas=replicas)
    return run, created


def _imported_results(
    *,
    csv_text: str | None,
    files: Sequence[tuple[str, str]] | None,
    file_format: str,
    gpus_per_replica: int | None,
    replicas: int,
) -> tuple[importers.ImportedResults, int]:
    """The files read and checked against what the caller said of them, and the GPUs of a
    replica (the caller's, else what the files say, else 1)."""
    if (csv_text is None) == (files is None):
        raise DomainError("Give a CSV table or result files, not both.", field="file")
    if csv_text is not None:
        files, file_format = [("CSV", csv_text)], importers.CSV
    assert files is not None  # one of the two, as checked above
    if replicas < 1:
        raise DomainError("replicas must be at least 1.", field="replicas")
    results = importers.parse_result_files(files, file_format=file_format)
    if results.file_format == importers.CSV and replicas != 1:
        raise DomainError(
            "A CSV table's requests_per_s is per replica already; replicas applies to the "
            "tools' result files, which measure a whole endpoint.",
            field="replicas",
        )
    if gpus_per_replica is None:
        gpus_per_replica = results.gpus_per_replica or 1
    elif results.gpus_per_replica not in (None, gpus_per_replica):
        raise DomainError(
            f"The files say a replica ran on {results.gpus_per_replica} GPUs, not "
            f"{gpus_per_replica}.",
            field="gpus_per_replica",
        )
    if gpus_per_replica < 1:
        raise DomainError("gpus_per_replica must be at least 1.", field="gpus_per_replica")
    return results, gpus_per_replica


def _imported_run(
    results: importers.ImportedResults,
    *,
    served_model: ServedModel,
    gpu_type: GpuType,
    gpus_per_replica: int,
    replicas: int,
    source_detail: str,
) -> BenchmarkRun:
    """The succeeded run that holds imported results."""
    now = timezone.now()
    shapes = results.distinct_shapes
    samples = results.samples
    return BenchmarkRun.objects.create(
        served_model=served_model,
        gpu_type=gpu_type,
        gpus_per_replica=gpus_per_replica,
        replicas=replicas,
        engine_model_id=results.engine_model_id,
        source=BenchmarkRun.Source.IMPORT,
        source_detail=source_detail[:500],
        status=BenchmarkRun.Status.SUCCEEDED,
        progress_done=shapes,
        progress_total=shapes,
        progress_message=(
            f"imported {len(samples)} rows"
            if results.file_format == importers.CSV
            else f"imported {len(samples)} {results.file_format} records, {shapes} shapes"
        ),
        started_at=now,
        finished_at=now,
        heartbeat_at=now,
    )


def _imported_samples(
    run: BenchmarkRun, results: importers.ImportedResults, *, replicas: int
) -> None:
    """The imported samples, per replica (the tools' files measure a whole endpoint)."""
    BenchmarkSample.objects.bulk_create(
        BenchmarkSample(
            run=run,
            input_len=sample.input_len,
            output_len=sample.output_len,
            cached_input_len=sample.cached_input_len,
            concurrency=sample.concurrency,
            requests_per_s=sample.requests_per_s / replicas,
            input_tokens_per_s=sample.requests_per_s / replicas * sample.input_len,
            output_tokens_per_s=sample.requests_per_s / replicas * sample.output_len,
            ttft_p50_ms=sample.ttft_p50_ms,
            ttft_p95_ms=sample.ttft_p95_ms,
            tpot_p50_ms=sample.tpot_p50_ms,
            tpot_p95_ms=sample.tpot_p95_ms,
            e2e_p95_ms=sample.e2e_p95_ms,
            request_count=sample.request_count,
            error_count=sample.error_count,
            sustainable=sustainable,
        )
        for sample, sustainable in zip(results.samples, results.sustainable, strict=True)
    )


# --- Fitting -----------------------------------------------------------------------------------


def _latest_fittable_run(served_model, gpu_type, gpus_per_replica) -> BenchmarkRun | None:
    return (
        BenchmarkRun.objects.filter(
            served_model=served_model,
            gpu_type=gpu_type,
            gpus_per_replica=gpus_per_replica,
            status=BenchmarkRun.Status.SUCCEEDED,
        )
        .order_by("-finished_at", "-id")
        .first()
    )


def cost_model_fit(
    *,
    run: BenchmarkRun | None = None,
    served_model: ServedModel | None = None,
    gpu_type: GpuType | None = None,
    gpus_per_replica: int | None = None,
) -> CostModel:
    """Fit a new cost-model version from a succeeded run (default: the latest one)."""
    if run is None:
        run = _run_to_fit(served_model, gpu_type, gpus_per_replica)
    if run.status != BenchmarkRun.Status.SUCCEEDED:
        raise DomainError(
            f"Run {run.pk} is {run.status}; only a succeeded run is fitted.",
            field="run",
            code="run_not_succeeded",
            status=409,
        )
    result = _fit_of(run)
    replica_mu_per_minute = REPLICA_MU_PER_MINUTE
    mu_per_unit = mu_coefficients(result.weights_replica_seconds, replica_mu_per_minute)
    held_because = ""
    if run.source_detail.startswith(SHARED_ENDPOINT):
        # Its throughput may include customers' requests: a planner decides, never the fit.
        held_because = (
            "measured at the deployment's endpoint, shared with customers' traffic, not on "
            "replicas held for the run"
        )
    # The version and its source commit together.
    with transaction.atomic():
        cost_model = cost_model_record(
            held_because=held_because,
            served_model=run.served_model,
            gpu_type=run.gpu_type,
            gpus_per_replica=run.gpus_per_replica,
            features=result.features,
            weights_replica_seconds=result.weights_replica_seconds,
            mu_per_unit=mu_per_unit,
            sample_count=result.sample_count,
            distinct_shapes=result.distinct_shapes,
            cv_mape=result.cv_mape,
            cv_worst_error=result.cv_worst_error,
            cv_error_by_feature=result.cv_error_by_feature,
            candidates=_candidates_of(result),
            residuals=_residuals_of(result),
            replica_mu_per_minute=replica_mu_per_minute,
        )
        cost_model_source_set(cost_model=cost_model, run=run)
    return cost_model


def _run_to_fit(
    served_model: ServedModel | None, gpu_type: GpuType | None, gpus_per_replica: int | None
) -> BenchmarkRun:
    """The latest succeeded run of the model on the GPU type, with `gpus_per_replica` GPUs
    (default: as many as its latest succeeded run on that type had)."""
    if served_model is None or gpu_type is None:
        raise DomainError("Give a run, or a model and a GPU type.", field="run")
    gpus = gpus_per_replica
    if gpus is None:
        latest = (
            BenchmarkRun.objects.filter(
                served_model=served_model,
                gpu_type=gpu_type,
                status=BenchmarkRun.Status.SUCCEEDED,
            )
            .order_by("-finished_at", "-id")
            .first()
        )
        gpus = latest.gpus_per_replica if latest else 1
    run = _latest_fittable_run(served_model, gpu_type, gpus)
    if run is None:
        raise DomainError(
            f"No succeeded benchmark run for '{served_model.name}' on {gpu_type.name}"
            f"×{gpus}: import a table or run a benchmark first.",
            field="run",
            code="no_run",
        )
    return run


def _fit_of(run: BenchmarkRun) -> fitting.FitResult:
    """The fit of the run's sustainable samples: replica time per request shape."""
    samples = list(run.samples.filter(sustainable=True, requests_per_s__gt=0))
    shapes = [
        Shape(
            input_tokens=s.input_len - s.cached_input_len,
            output_tokens=s.output_len,
            cached_input_tokens=s.cached_input_len,
            images=s.images,
        )
        for s in samples
    ]
    try:
        return fitting.fit_cost_model(shapes, [s.requests_per_s for s in samples])
    except fitting.FitError as error:
        raise DomainError(str(error), field="run", code="cannot_fit") from None


def _candidates_of(result: fitting.FitResult) -> list[dict]:
    """The feature sets the fit compared, with their cross-validated errors."""
    return [
        {
            "features": list(candidate.features),
            "cv_mape": candidate.cv_mape,
            "cv_worst_error": candidate.cv_worst_error,
        }
        for candidate in result.candidates
    ]


def _residuals_of(result: fitting.FitResult) -> list[dict]:
    """Each sample's measured and predicted replica time."""
    return [
        {
            "input_tokens": residual.shape.input_tokens,
            "cached_input_tokens": residual.shape.cached_input_tokens,
            "output_tokens": residual.shape.output_tokens,
            "images": residual.shape.images,
            "measured_replica_seconds": residual.measured_replica_seconds,
            "predicted_replica_seconds": residual.predicted_replica_seconds,
            "relative_error": residual.relative_error,
        }
        for residual in result.residuals
    ]

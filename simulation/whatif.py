"""What-if runs: the fleet simulator over a trace with a planner's settings, as a Celery job.

`whatif_create(...)` checks everything up front — the trace is loaded (an uploaded CSV's
error names its line), the numbers are in range, the reservations parse (an error names the
line and the client), the model config is valid — and raises `DomainError(field=...)` naming
the form field at fault; otherwise it stores a queued `WhatIfRun` and queues
`simulation.run_whatif` once the transaction commits. `whatif_execute(run_id)` claims the
run, simulates (progress: one step per policy, static-peak first) and stores `compare()`'s
output, or ends the run as failed with the message.

The model: with a served model picked (and no replica profile pasted), the what-if starts from
that model's fleet (simulation.from_fleet): every one of its deployments (or the one picked),
each a replica from its own GPU type's active cost model and its engine profile, within its
max replicas, with its cold start and idle window, all within their pools' GPUs (a pool shared
by several deployments counted once); requests priced by its reference cost model; a
deployment without an active cost model left out with the reason. The live policy sizes each
deployment as it does live, the other policies are placed cheapest MU first
(simulation.engine.deployments), and the result adds each policy's cost and each deployment's
replica-hours, GPU-hours and cost (`result["deployments"]`). The form starts from its
reservations in term. A pasted model config JSON (`ModelConfig`'s
fields, as for `simulate --model-config`) simulates that replica instead, priced at its own
ground truth; with neither, the built-in profile of `manage.py simulate` (the engine
emulator's defaults: an 8B dense model on one H100, 60 s cold start).

The trace: a bundled one (`BUNDLED_TRACES`), an uploaded CSV (≤ 5 MB, kept in the row), in
either format `simulation.engine.traces` reads (rate windows draw request sizes from the Azure
conversation trace), or the picked model's own usage of the last `usage_days` days (`usage`,
replayed from its usage events; kept in the row as a CSV, so a later run of the same what-if
replays the same requests). Only the first `duration_minutes` are simulated (from the first
request), after scaling the demand by `rate_scale`.

Admission: every policy runs behind the live admission (simulation.engine.compare), and the
result reports per policy the refused share of guaranteed and of best-effort traffic.

Overcommit, a what-if on selling: with reservations, the fleet may hold at most what the sold
MU/min would deploy at that overcommit, `ceil(Σ reserved MU/min ÷ overcommit ÷ 100)` replicas
(a replica serves 100 MU/min saturated; a fleet's unit deployment on another GPU type, its
exchange rate; a fleet of several deployments places that capacity cheapest MU first).
Overcommit 1.5 is a fleet a third smaller than what was sold: does the SLO, and the guaranteed
traffic, survive? Without reservations it caps nothing.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from celery import current_app
from django.conf import settings as django_settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from capacity.models import Deployment, ServedModel
from capacity.pricing.features import REPLICA_MU_PER_MINUTE
from core.errors import DomainError
from simulation import from_fleet
from simulation.engine.compare import (
    MODELUNIT,
    REFERENCE,
    Comparison,
    compare,
    known_policies,
    policy_registry,
    request_mu_of_weights,
)
from simulation.engine.profile import ConfigError, ModelConfig, parse_config
from simulation.engine.traces import (
    TraceError,
    TraceRequest,
    TraceSummary,
    load_trace,
    summarise,
)
from simulation.models import WhatIfRun

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"
SIZES_TRACE = DATA / "traces" / "AzureLLMInferenceTrace_conv_2023.csv"
BUILT_IN_MODEL = ModelConfig(name="8b-h100", cold_start_seconds=60.0)
BUILT_IN_DESCRIPTION = (
    "the built-in profile: the engine emulator's 8B dense model on one H100 (bf16, batch 256, "
    "200k KV tokens), 60 s cold start"
)


@dataclass(frozen=True)
class BundledTrace:
    label: str
    path: Path
    sizes: Path | None = None  # rate windows draw request sizes from here


BUNDLED_TRACES = {
    "azure-conv": BundledTrace(
        "Azure conversation trace, 58 min, about 5.5 req/s, one client 'default'",
        DATA / "traces" / "AzureLLMInferenceTrace_conv_2023.csv",
    ),
    "azure-code": BundledTrace(
        "Azure code trace, 57 min, about 2.6 req/s with idle gaps, one client 'default'",
        DATA / "traces" / "AzureLLMInferenceTrace_code_2023.csv",
    ),
    "diurnal-2d": BundledTrace(
        "Diurnal, 2 days from midnight, clients acme, globex and initech (rate windows; sizes "
        "from the conversation trace)",
        DATA / "scenarios" / "diurnal_2d.csv",
        sizes=SIZES_TRACE,
    ),
}
DEFAULT_TRACE = "azure-conv"
# The picked model's own usage, replayed (simulation.from_fleet.usage_trace_csv).
USAGE_TRACE = "usage"
USAGE_LABEL = "This model's own usage, replayed from its usage events (the last days below)"
DEFAULT_POLICIES = ("static-peak", "kpa", "hpa-rps", "oracle", "modelunit")
# References that read the future: never the best policy. (oracle-slo and static-slo are
# offered, not run by default: they cost several runs of the trace each.)
HINDSIGHT = ("oracle", "oracle-slo")

# The Celery task that executes a run (simulation.tasks), queued by this name.
RUN_TASK = "simulation.run_whatif"

MAX_UPLOAD_BYTES = 5 * 1024 * 1024
# A what-if should finish in seconds: about 5 s per policy per 20,000 requests on one core.
MAX_REQUESTS = 60_000
TASK_TIME_LIMIT_SECONDS = 600

# field -> (default, low, high, low is exclusive)
LIMITS = {
    # A week: the fleet's own usage may be replayed whole (MAX_REQUESTS still bounds a run).
    "duration_minutes": (30, 1, 7 * 24 * 60, False),
    "usage_days": (from_fleet.DEFAULT_USAGE_DAYS, *from_fleet.USAGE_DAYS, False),
    "rate_scale": (1.0, 0.0, 20.0, True),
    "slo_ttft_ms": (2000.0, 0.0, 600_000.0, True),
    "slo_goal": (0.99, 0.0, 1.0, True),
    "target_utilisation": (0.8, 0.0, 1.0, True),
    "cold_start_seconds": (None, 0.0, 3600.0, False),
    "tick_seconds": (15.0, 1.0, 300.0, False),
    "overcommit": (1.0, 0.0, 10.0, True),
}
MAX_RESERVATIONS = 200
MAX_RESERVATION_MU_PER_MINUTE = 1_000_000.0
_CLIENT = re.compile(r"^[^\s=,#]{1,100}$")


def describe_limit(field: str) -> str:
    """The range a number field accepts, as an error or a form says it."""
    _, low, high, exclusive = LIMITS[field]
    return f"{'>' if exclusive else '≥'} {low:g} and ≤ {high:g}"


# --- Validation ------------------------------------------------------------------------------


def _number(field: str, value, *, integer: bool = False) -> float | None:
    default, low, high, exclusive = LIMITS[field]
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise DomainError(f"{field} must be a number, got {value!r}.", field=field)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DomainError(f"{field} must be a number, got {value!r}.", field=field) from None
    if not math.isfinite(number) or number > high or number < low or (exclusive and number == low):
        raise DomainError(f"{field} must be {describe_limit(field)}, got {value!r}.", field=field)
    if integer:
        if number != int(number):
            raise DomainError(f"{field} must be a whole number, got {value!r}.", field=field)
        return int(number)
    return number


def parse_reservations(text_or_dict) -> dict[str, float]:
    """`client = MU/min` lines (blank lines and `#` comments ignored), or a dict."""
    if isinstance(text_or_dict, dict):
        lines = [f"{client} = {mu}" for client, mu in text_or_dict.items()]
    else:
        lines = (text_or_dict or "").splitlines()
    reservations: dict[str, float] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"line {number}"
        if "=" not in line:
            raise DomainError(
                f"{where}: expected 'client = MU/min', got {raw.strip()!r}.", field="reservations"
            )
        client, _, amount = (part.strip() for part in line.partition("="))
        if not _CLIENT.match(client):
            raise DomainError(
                f"{where}: the client name {client!r} must be 1-100 characters without spaces, "
                "'=', ',' or '#'.",
                field="reservations",
            )
        where = f"{where} ({client})"
        try:
            mu = float(amount)
        except ValueError:
            raise DomainError(
                f"{where}: MU/min {amount!r} is not a number.", field="reservations"
            ) from None
        if not math.isfinite(mu) or mu <= 0 or mu > MAX_RESERVATION_MU_PER_MINUTE:
            raise DomainError(
                f"{where}: MU/min must be > 0 and ≤ {MAX_RESERVATION_MU_PER_MINUTE:,.0f}, "
                f"got {amount}.",
                field="reservations",
            )
        if client in reservations:
            raise DomainError(f"{where}: {client} is reserved twice.", field="reservations")
        reservations[client] = mu
    if len(reservations) > MAX_RESERVATIONS:
        raise DomainError(
            f"at most {MAX_RESERVATIONS} reservations, got {len(reservations)}.",
            field="reservations",
        )
    return reservations


def format_reservations(reservations: dict[str, float]) -> str:
    """Reservations as the `client = MU/min` lines parse_reservations reads."""
    return "\n".join(f"{client} = {mu:g}" for client, mu in reservations.items())


def parse_model_config(raw) -> dict | None:
    """A model config (JSON text or an already parsed object) → ModelConfig's fields, or None
    for the built-in profile."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DomainError(
                f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}.",
                field="model_config",
            ) from None
    if isinstance(raw, dict) and "models" not in raw:
        raw = {"models": [raw]}
    try:
        config = parse_config(raw)
    except ConfigError as exc:
        raise DomainError(str(exc), field="model_config") from None
    if not config.models:
        raise DomainError("the config holds no model.", field="model_config")
    return asdict(config.models[0])


def model_of(settings: dict) -> ModelConfig:
    """The replica a run simulates: its settings' model config, or the built-in profile."""
    fields = settings.get("model_config")
    return ModelConfig(**fields) if fields else BUILT_IN_MODEL


def parse_policies(policies) -> list[str]:
    """The policies asked for (a list, or names separated by commas; none: the
    defaults), static-peak first; a DomainError names an unknown or unavailable one."""
    if isinstance(policies, str):
        policies = [p.strip() for p in policies.split(",") if p.strip()]
    policies = list(dict.fromkeys(policies or DEFAULT_POLICIES))
    known = known_policies()
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise DomainError(
            f"unknown policy {unknown[0]!r} (known: {', '.join(known)}).", field="policies"
        )
    if MODELUNIT in policies:
        _, missing = policy_registry()
        if MODELUNIT in missing:
            raise DomainError(missing[MODELUNIT], field="policies")
    # static-peak is the reference savings are measured against: it always runs, first.
    return [REFERENCE] + [p for p in policies if p != REFERENCE]


def fleet_cap(
    reservations: dict[str, float],
    overcommit: float,
    replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE,
) -> int | None:
    """Replicas the sold MU/min would deploy at `overcommit` (None: nothing sold, no cap)."""
    reserved = sum(reservations.values())
    if reserved <= 0:
        return None
    return max(1, math.ceil(reserved / overcommit / replica_mu_per_minute - 1e-9))


# --- Traces ----------------------------------------------------------------------------------


def _safe_filename(name: str) -> str:
    base = Path(name or "upload.csv").name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base)[:100] or "upload.csv"


def _truncated_windows(text: str, limit_s: float) -> str:
    """Rate windows cut after the first window of each client that starts at or past the limit
    (which still gives the last kept window its length), so that two days of windows do not
    generate two days of requests. Dropped rows become blank lines, so the loader's line
    numbers stay those of the file; anything that does not parse leaves the text as it is, for
    the loader to report."""
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error:
        return text
    if not rows:
        return text
    header = [cell.strip().lower() for cell in rows[0]]
    if "window_start_s" not in header:
        return text
    start_col = header.index("window_start_s")
    client_col = header.index("client") if "client" in header else None
    starts: list[float | None] = []
    for row in rows[1:]:
        if not any(cell.strip() for cell in row):
            starts.append(None)
            continue
        try:
            starts.append(float(row[start_col]))
        except (ValueError, IndexError):
            return text
        if client_col is not None and client_col >= len(row):
            return text
    known = [start for start in starts if start is not None]
    if not known:
        return text
    first = min(known)
    kept, done = [rows[0]], set()
    for row, start in zip(rows[1:], starts, strict=True):
        client = row[client_col].strip() if client_col is not None and start is not None else ""
        if start is None or client in done:
            kept.append([])
            continue
        kept.append(row)
        if start >= first + limit_s:
            done.add(client)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(kept)
    return out.getvalue()


def load_requests(
    *,
    trace_name: str = "",
    trace_csv: str = "",
    trace_filename: str = "",
    duration_minutes: int,
    rate_scale: float,
) -> list[TraceRequest]:
    """The first `duration_minutes` of the trace (from its first request), scaled; raises
    TraceError (naming the file and line) for a bad trace."""
    limit_s = duration_minutes * 60.0
    with tempfile.TemporaryDirectory(prefix="whatif-") as folder:
        if trace_csv:
            path = Path(folder) / _safe_filename(trace_filename)
            text = trace_csv
            sizes = SIZES_TRACE
        else:
            bundled = BUNDLED_TRACES[trace_name]
            path = Path(folder) / bundled.path.name
            text = bundled.path.read_text(encoding="utf-8-sig")
            sizes = bundled.sizes or SIZES_TRACE
        path.write_text(_truncated_windows(text, limit_s), encoding="utf-8")
        first_line = text.lstrip("\ufeff").split("\n", 1)[0].lower()
        is_windows = "window_start_s" in first_line or "rate_req_per_s" in first_line
        requests = load_trace(path, sizes_path=sizes if is_windows else None, scale=rate_scale)
    if not requests:
        return []
    start = requests[0].arrival_s
    return [r for r in requests if r.arrival_s < start + limit_s]


# --- Creating --------------------------------------------------------------------------------


def whatif_create(
    *,
    requested_by=None,
    served_model: ServedModel | None = None,
    deployment: Deployment | None = None,
    trace_name: str = "",
    trace_csv: str | bytes = "",
    trace_filename: str = "",
    usage_days=None,
    model_config=None,
    policies=None,
    reservations="",
    overcommit=None,
    keep_warm: bool = False,
    duration_minutes=None,
    rate_scale=None,
    slo_ttft_ms=None,
    slo_goal=None,
    target_utilisation=None,
    cold_start_seconds=None,
    tick_seconds=None,
) -> WhatIfRun:
    """Validate a what-if and queue it (on commit). Raises DomainError naming the field."""
    numbers = {
        "duration_minutes": _number("duration_minutes", duration_minutes, integer=True),
        "rate_scale": _number("rate_scale", rate_scale),
        "slo_ttft_ms": _number("slo_ttft_ms", slo_ttft_ms),
        "slo_goal": _number("slo_goal", slo_goal),
        "target_utilisation": _number("target_utilisation", target_utilisation),
        "cold_start_seconds": _number("cold_start_seconds", cold_start_seconds),
        "tick_seconds": _number("tick_seconds", tick_seconds),
        "overcommit": _number("overcommit", overcommit),
    }
    chosen = parse_policies(policies)
    parsed_reservations = parse_reservations(reservations)
    model_fields = parse_model_config(model_config)
    if served_model is None and deployment is not None:
        served_model = deployment.served_model
    # The fleet's replica, unless a replica profile was pasted to simulate instead.
    fleet = (
        from_fleet.fleet_of(served_model, deployment)
        if served_model is not None and model_fields is None
        else None
    )
    trace = _trace_of(
        trace_name=trace_name,
        trace_csv=trace_csv,
        trace_filename=trace_filename,
        served_model=served_model,
        usage_days=usage_days,
        numbers=numbers,
    )
    requests = _requests_within_bounds(trace, numbers)
    settings = {
        **numbers,
        "policies": chosen,
        "reservations": parsed_reservations,
        "keep_warm": bool(keep_warm),
        **_fleet_and_caps(fleet, requests, parsed_reservations, numbers, model_fields),
        **trace.extra,
    }
    with transaction.atomic():
        run = WhatIfRun.objects.create(
            requested_by=requested_by,
            served_model=served_model,
            trace_name=trace.name,
            trace_filename=_safe_filename(trace.filename) if trace.csv else "",
            trace_csv=trace.csv,
            settings=settings,
            progress_total=len(chosen),
            progress_message="queued",
        )
        run_id = run.pk
        transaction.on_commit(lambda: _queue_task(run_id))
    return run


@dataclass(frozen=True)
class _Trace:
    """The trace a what-if replays: a bundled one by `name`, or a CSV (uploaded, or the model's
    own usage); `error_field` is the form field its errors name, `extra` what the settings keep of
    its source."""

    name: str
    csv: str
    filename: str
    error_field: str
    extra: dict = field(default_factory=dict)


def _trace_of(
    *,
    trace_name: str,
    trace_csv: str | bytes,
    trace_filename: str,
    served_model: ServedModel | None,
    usage_days,
    numbers: dict,
) -> _Trace:
    """The trace asked for, checked: an upload within MAX_UPLOAD_BYTES and in UTF-8, the
    usage of a picked model, or a bundled trace that exists."""
    if isinstance(trace_csv, bytes):
        if len(trace_csv) > MAX_UPLOAD_BYTES:
            raise _too_big(len(trace_csv))
        try:
            trace_csv = trace_csv.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise DomainError(
                f"{trace_filename or 'the file'} is not a UTF-8 text (CSV) file.",
                field="trace_file",
            ) from None
    if trace_csv:
        if len(trace_csv.encode("utf-8")) > MAX_UPLOAD_BYTES:
            raise _too_big(len(trace_csv.encode("utf-8")))
        return _Trace(name="", csv=trace_csv, filename=trace_filename, error_field="trace_file")
    if trace_name == USAGE_TRACE:
        return _usage_trace(served_model, usage_days=usage_days, numbers=numbers)
    trace_name = trace_name or ""
    if trace_name not in BUNDLED_TRACES:
        raise DomainError(
            f"unknown bundled trace {trace_name!r} (bundled: {', '.join(BUNDLED_TRACES)}); "
            "or upload a CSV.",
            field="trace",
        )
    return _Trace(name=trace_name, csv="", filename=trace_filename, error_field="trace")


def _usage_trace(served_model: ServedModel | None, *, usage_days, numbers: dict) -> _Trace:
    """The picked model's usage of the last `usage_days` days, as a CSV the row keeps."""
    if served_model is None:
        raise DomainError("pick a model: the usage replayed is that model's own.", field="trace")
    days = _number("usage_days", usage_days, integer=True)
    thinning = numbers["rate_scale"]
    trace_csv, events = from_fleet.usage_trace_csv(
        served_model,
        days=days,
        duration_minutes=numbers["duration_minutes"],
        # Enough for the scale to thin out, not so many that a row holds megabytes.
        max_rows=min(4 * MAX_REQUESTS, math.ceil(MAX_REQUESTS / min(1.0, thinning))),
        now=timezone.now(),
    )
    return _Trace(
        name="",
        csv=trace_csv,
        filename=f"usage-{served_model.name}-{days}d.csv",
        error_field="trace",
        extra={"trace_source": USAGE_TRACE, "usage_days": days, "usage_events": events},
    )


def _requests_within_bounds(trace: _Trace, numbers: dict) -> list[TraceRequest]:
    """The trace's requests a run would simulate: at least one, at most MAX_REQUESTS."""
    try:
        requests = load_requests(
            trace_name=trace.name,
            trace_csv=trace.csv,
            trace_filename=trace.filename,
            duration_minutes=numbers["duration_minutes"],
            rate_scale=numbers["rate_scale"],
        )
    except TraceError as exc:
        raise DomainError(str(exc), field=trace.error_field) from None
    if not requests:
        raise DomainError("the trace has no requests.", field=trace.error_field)
    if len(requests) > MAX_REQUESTS:
        raise DomainError(
            f"the first {numbers['duration_minutes']} minutes at rate scale "
            f"{numbers['rate_scale']:g} hold {len(requests):,} requests; a what-if simulates at "
            f"most {MAX_REQUESTS:,}: shorten the duration or lower the scale.",
            field="duration_minutes",
        )
    return requests


def _fleet_and_caps(
    fleet,
    requests: list[TraceRequest],
    reservations: dict[str, float],
    numbers: dict,
    model_fields: dict | None,
) -> dict:
    """The settings of the simulated replica and fleet: the fleet's (with its replica, in place
    of `model_fields`) when one was read, and the fleet cap, the lower of the fleet's own and
    what the sold reservations deploy at the overcommit."""
    replica_mu_per_minute = REPLICA_MU_PER_MINUTE
    fleet_settings = None
    caps = []
    if fleet is not None:
        model_fields, fleet_settings = from_fleet.fleet_settings(fleet, requests)
        replica_mu_per_minute = fleet_settings["replica_mu_per_minute"]
        caps.append(fleet_settings["max_replicas"])
    overcommit_cap = fleet_cap(reservations, numbers["overcommit"], replica_mu_per_minute)
    if overcommit_cap is not None:
        caps.append(overcommit_cap)
    return {
        "model_config": model_fields,
        "overcommit_max_replicas": overcommit_cap,
        "max_replicas": min(caps) if caps else None,
        "fleet": fleet_settings,
    }


def _too_big(size: int) -> DomainError:
    return DomainError(
        f"the file is {size / 1024 / 1024:.1f} MB; the limit is "
        f"{MAX_UPLOAD_BYTES // 1024 // 1024} MB. Upload the first part of the trace, or rate "
        "windows.",
        field="trace_file",
    )


def _queue_task(run_id: int) -> None:
    # By name (simulation.tasks registers it, and imports this module): routed to the
    # benchmarks queue by CELERY_TASK_ROUTES.
    current_app.send_task(RUN_TASK, args=[run_id])


# --- Executing -------------------------------------------------------------------------------


def whatif_claim(run_id: int) -> bool:
    """Mark a queued run running; False when it was not queued (another delivery took
    it)."""
    return bool(
        WhatIfRun.objects.filter(pk=run_id, status=WhatIfRun.Status.QUEUED).update(
            status=WhatIfRun.Status.RUNNING,
            started_at=timezone.now(),
            progress_message="loading the trace",
        )
    )


def whatif_fail(run_id: int, error: str) -> bool:
    """End a queued or running run as failed with `error`; False when it had ended."""
    return bool(
        WhatIfRun.objects.filter(
            pk=run_id, status__in=[WhatIfRun.Status.QUEUED, WhatIfRun.Status.RUNNING]
        ).update(
            status=WhatIfRun.Status.FAILED,
            error=error[:5000],
            progress_message="failed",
            finished_at=timezone.now(),
        )
    )


def _finite(value):
    """JSON for PostgreSQL: NaN and infinities (no percentile, no reference) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _fleet_arguments(fleet: dict | None) -> dict:
    """compare()'s arguments for a fleet's what-if: its currency, GPUs and idle window, and its
    deployments (runs from before whole-model what-ifs kept one deployment's keys only)."""
    if not fleet:
        return {}
    reference = fleet["reference_cost_model"]
    arguments = {
        "request_mu": request_mu_of_weights(
            reference["weights_replica_seconds"], reference["replica_mu_per_minute"]
        ),
        "replica_mu_per_minute": fleet["replica_mu_per_minute"],
        "gpus_per_replica": fleet["gpus_per_replica"],
        "scale_to_zero_after_seconds": fleet["scale_to_zero_after_seconds"],
    }
    if fleet.get("deployments"):
        arguments["fleet"] = from_fleet.engine_fleet(fleet)
    return arguments


def whatif_execute(run_id: int) -> WhatIfRun | None:
    """Claim a queued run and simulate it; None when it was not queued (already taken)."""
    if not whatif_claim(run_id):
        logger.info("what-if %s was not queued; nothing to do", run_id)
        return None
    run = WhatIfRun.objects.get(pk=run_id)
    settings = run.settings
    try:
        requests = load_requests(
            trace_name=run.trace_name,
            trace_csv=run.trace_csv,
            trace_filename=run.trace_filename,
            duration_minutes=settings["duration_minutes"],
            rate_scale=settings["rate_scale"],
        )
        if not requests:
            raise ValueError("the trace has no requests")
        model = model_of(settings)
        report = _compared(run_id, requests, model, settings)
    except Exception as error:  # noqa: BLE001 - whatever broke, the row says why
        logger.info("what-if %s failed: %s", run_id, error, exc_info=True)
        message = str(error) if isinstance(error, TraceError | ValueError) else None
        whatif_fail(run_id, message or f"{type(error).__name__}: {error}")
        return WhatIfRun.objects.get(pk=run_id)
    summary = summarise(requests)
    WhatIfRun.objects.filter(pk=run_id, status=WhatIfRun.Status.RUNNING).update(
        status=WhatIfRun.Status.SUCCEEDED,
        result=_finite(_result(report, summary, model, settings)),
        progress_done=F("progress_total"),
        progress_message=f"simulated {summary.requests:,} requests under {len(report['policies'])} "
        "policies",
        finished_at=timezone.now(),
    )
    return WhatIfRun.objects.get(pk=run_id)


def _compared(
    run_id: int, requests: list[TraceRequest], model: ModelConfig, settings: dict
) -> Comparison:
    """compare() over the run's settings, its progress written to the row after each policy."""
    policies = settings["policies"]
    WhatIfRun.objects.filter(pk=run_id).update(
        progress_total=len(policies),
        progress_message=f"simulating {len(requests):,} requests: {policies[0]}",
    )

    def on_policy(name: str, done: int, total: int) -> None:
        following = policies[done] if done < len(policies) else None
        WhatIfRun.objects.filter(pk=run_id).update(
            progress_done=done,
            progress_total=total,
            progress_message=(
                f"{name} done; simulating {following}" if following else f"{name} done"
            ),
        )

    return compare(
        requests,
        model=model,
        policies=policies,
        slo_ttft_ms=settings["slo_ttft_ms"],
        cold_start_seconds=settings["cold_start_seconds"],
        target_utilisation=settings["target_utilisation"],
        reservations=settings["reservations"],
        keep_warm=settings["keep_warm"],
        tick_seconds=settings["tick_seconds"],
        max_replicas=settings["max_replicas"],
        on_policy=on_policy,
        stabilisation_seconds=float(django_settings.ALLOCATION_STABILISATION_SECONDS),
        burst_seconds=float(django_settings.ADMISSION_BURST_SECONDS),
        **_fleet_arguments(settings.get("fleet")),
    )


def _result(report: Comparison, summary: TraceSummary, model: ModelConfig, settings: dict) -> dict:
    """What the run keeps: compare()'s report, the trace simulated and the fleet cap."""
    result = {
        **report,
        "trace": {
            "requests": summary.requests,
            "duration_s": summary.duration_s,
            "mean_rate_req_per_s": summary.mean_rate_req_per_s,
            "peak_rate_req_per_s_1min": summary.peak_rate_req_per_s_1min,
            "mean_input_tokens": summary.mean_input_tokens,
            "mean_output_tokens": summary.mean_output_tokens,
            "clients": list(summary.clients),
        },
        "model": model.name,
        "max_replicas": settings["max_replicas"],
    }
    deployments = (settings.get("fleet") or {}).get("deployments") or []
    if len(deployments) > 1:
        # The fleet, and the replicas its cap counts (its unit deployment's).
        result["model"] = ", ".join(row["name"] for row in deployments)
        result["unit"] = model.name
    return result


# --- Reading ---------------------------------------------------------------------------------


def best_policy(run: WhatIfRun) -> str | None:
    """The cheapest policy a live system could run (not the oracles, which read the future)
    that met the SLO goal with no request within a reservation refused (runs from before
    admission was simulated: no reserved customer's request unserved); None if none did. Ties
    go to the higher SLO attainment, then to the policy simulated first."""
    if not run.result:
        return None
    goal = run.settings.get("slo_goal", LIMITS["slo_goal"][0])
    order = {name: index for index, name in enumerate(run.settings.get("policies", []))}
    candidates = [
        (row["gpu_hours"], -row["slo_attainment"], order.get(name, len(order)), name)
        for name, row in run.result["policies"].items()
        if name not in HINDSIGHT
        and row.get("gpu_hours") is not None
        and row.get("slo_attainment") is not None
        and row["slo_attainment"] >= goal - 1e-12
        # Behind admission a reserved customer's demand beyond its reservation may be refused
        # as any best-effort demand; what a reservation promises is the part within it.
        and not row.get("within_reservation_refused", row.get("guaranteed_refused"))
    ]
    return min(candidates)[-1] if candidates else None

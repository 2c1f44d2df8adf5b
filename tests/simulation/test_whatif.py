"""What-if runs: validation names the field and the reason, execution stores a comparison of
every chosen policy with progress per policy, failures are recorded, and overcommit shrinks the
simulated fleet. Real PostgreSQL; short traces so the simulations take a second or so."""

import json

import numpy as np
import pytest

from core.errors import DomainError
from dataplane.emulator.config import ModelConfig
from simulation import whatif
from simulation.engine.compare import compare
from simulation.engine.traces import TraceRequest
from simulation.models import WhatIfRun

pytestmark = pytest.mark.django_db


def trace_csv(minutes: float = 3, rate: float = 3.0, seed: int = 0) -> str:
    """A small per-request trace: Poisson arrivals, clients acme and initech."""
    rng = np.random.default_rng(seed)
    t, lines = 0.0, ["timestamp,input_tokens,output_tokens,client"]
    while True:
        t += rng.exponential(1 / rate)
        if t >= minutes * 60:
            break
        client = "acme" if rng.random() < 0.6 else "initech"
        lines.append(f"{t:.3f},{rng.integers(100, 1500)},{rng.integers(20, 300)},{client}")
    return "\n".join(lines) + "\n"


def create(**overrides) -> WhatIfRun:
    values = {"trace_name": "azure-conv", "duration_minutes": 3, "policies": ["static-peak"]}
    return whatif.whatif_create(**(values | overrides))


def refusal(**overrides) -> DomainError:
    with pytest.raises(DomainError) as caught:
        create(**overrides)
    assert not WhatIfRun.objects.exists()
    return caught.value


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"trace_name": "no-such-trace"}, "trace", "unknown bundled trace 'no-such-trace'"),
        (
            {"trace_csv": "timestamp,input_tokens,output_tokens\n0,10,5\n1,ten,5\n"},
            "trace_file",
            "line 3: input_tokens 'ten' is not a number",
        ),
        (
            {"trace_csv": "when,prompt\n0,10\n", "trace_filename": "mine.csv"},
            "trace_file",
            "mine.csv line 1: unrecognised header (when, prompt)",
        ),
        ({"trace_csv": b"\xff\xfe\x00bad"}, "trace_file", "not a UTF-8 text"),
        ({"trace_csv": b"x" * (whatif.MAX_UPLOAD_BYTES + 1)}, "trace_file", "the limit is 5 MB"),
        ({"target_utilisation": 1.5}, "target_utilisation", "must be > 0 and ≤ 1"),
        ({"overcommit": 0}, "overcommit", "must be > 0"),
        ({"duration_minutes": 0}, "duration_minutes", "must be ≥ 1"),
        ({"duration_minutes": 2.5}, "duration_minutes", "whole number"),
        ({"slo_ttft_ms": "fast"}, "slo_ttft_ms", "must be a number"),
        ({"cold_start_seconds": -1}, "cold_start_seconds", "must be ≥ 0"),
        ({"reservations": "acme = 30\nglobex = lots"}, "reservations", "line 2 (globex)"),
        ({"reservations": "acme 30"}, "reservations", "line 1: expected 'client = MU/min'"),
        ({"reservations": "acme = -5"}, "reservations", "line 1 (acme): MU/min must be > 0"),
        ({"reservations": "acme = 5\nacme = 6"}, "reservations", "acme is reserved twice"),
        ({"policies": ["kpa", "magic"]}, "policies", "unknown policy 'magic'"),
        ({"model_config": "{not json"}, "model_config", "invalid JSON at line 1"),
        ({"model_config": '{"name": "m", "max_num_seq": 5}'}, "model_config", "max_num_seq"),
        (
            {"trace_name": "azure-conv", "duration_minutes": 60, "rate_scale": 20},
            "duration_minutes",
            "shorten the duration or lower the scale",
        ),
    ],
)
def test_a_bad_what_if_is_refused_naming_the_field_and_the_reason(overrides, field, reason):
    error = refusal(**overrides)
    assert error.field == field
    assert reason in error.message


def test_a_what_if_is_queued_once_the_transaction_commits(
    planner, served_model, sellable, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks() as callbacks:
        run = create(
            requested_by=planner,
            served_model=served_model,
            reservations="# sold today\ndefault = 250\n",
            overcommit=2,
        )
    assert len(callbacks) == 1
    run.refresh_from_db()
    assert run.status == WhatIfRun.Status.QUEUED
    assert run.progress_total == 1
    assert run.settings["reservations"] == {"default": 250.0}
    assert run.settings["max_replicas"] == 2  # ceil(250 / 2 / 100)
    assert run.settings["cold_start_seconds"] is None  # the profile's own


def test_executing_stores_a_comparison_of_every_chosen_policy_and_static_peak():
    run = create(
        trace_csv=trace_csv(minutes=3),
        trace_filename="small trace.csv",
        policies=["kpa", "hpa-rps", "oracle"],
        reservations="acme = 150",
    )
    assert run.trace_filename == "small_trace.csv"
    assert run.progress_total == 4

    done = whatif.whatif_execute(run.pk)

    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    assert done.settings["policies"] == ["static-peak", "kpa", "hpa-rps", "oracle"]
    assert set(done.result["policies"]) == set(done.settings["policies"])
    assert (done.progress_done, done.progress_total) == (4, 4)
    static = done.result["policies"]["static-peak"]
    assert static["savings_vs_static"] == 0
    assert static["gpu_hours"] > 0
    for row in done.result["policies"].values():
        assert 0 <= row["slo_attainment"] <= 1
        assert set(row) >= {"ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "guaranteed_refused"}
    assert done.result["trace"]["clients"] == ["acme", "initech"]
    assert done.result["trace"]["duration_s"] < 180
    assert done.started_at <= done.finished_at
    # A second delivery of the task finds the run taken and does nothing.
    assert whatif.whatif_execute(run.pk) is None


def test_a_whatif_runs_the_searched_references_and_never_calls_oracle_slo_best():
    run = create(trace_csv=trace_csv(minutes=3), policies=["modelunit", "static-slo", "oracle-slo"])

    done = whatif.whatif_execute(run.pk)

    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    rows = done.result["policies"]
    assert set(rows) == {"static-peak", "modelunit", "static-slo", "oracle-slo"}
    assert rows["oracle-slo"]["oracle_slo_savings_share"] == pytest.approx(1.0)
    assert rows["static-slo"]["static_replicas"] >= 1
    assert rows["oracle-slo"]["slo_attainment"] >= 0.99
    # It reads the future: a reference, never the best policy to run.
    assert whatif.best_policy(done) in {"static-peak", "modelunit", "static-slo"}


def test_only_the_first_minutes_of_a_bundled_rate_window_trace_are_simulated():
    run = create(trace_name="diurnal-2d", duration_minutes=5, policies=["kpa"])
    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    assert done.result["trace"]["duration_s"] <= 300
    assert done.result["trace"]["clients"] == ["acme", "globex", "initech"]


def test_a_run_that_breaks_while_executing_is_failed_with_the_message():
    run = create(trace_csv=trace_csv(minutes=1), trace_filename="t.csv")
    # The stored trace is damaged after it was checked (say, edited in the admin).
    WhatIfRun.objects.filter(pk=run.pk).update(trace_csv="when,prompt\n0,10\n")
    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.FAILED
    assert "t.csv line 1: unrecognised header" in done.error
    assert done.result is None
    assert done.finished_at is not None


def test_overcommit_shrinks_the_fleet_sold_reservations_would_deploy():
    common = {
        "trace_name": "azure-conv",
        "duration_minutes": 4,
        "policies": ["static-peak", "hpa-rps"],
        "reservations": "default = 1000",
    }
    sold = whatif.whatif_execute(create(**common, overcommit=1).pk)
    oversold = whatif.whatif_execute(create(**common, overcommit=3).pk)
    assert (sold.result["max_replicas"], oversold.result["max_replicas"]) == (10, 4)
    at_1, at_3 = sold.result["policies"], oversold.result["policies"]
    # Static-peak sizes for the 1,000 MU/min sold (13 replicas at 80 %): capped at 10, then 4.
    assert at_3["static-peak"]["gpu_hours"] < at_1["static-peak"]["gpu_hours"]
    # Four replicas for the four scored minutes (and the tail while the last requests finish).
    assert 4 * 4 / 60 <= at_3["static-peak"]["gpu_hours"] <= 4 * 5 / 60
    assert at_3["static-peak"]["slo_attainment"] <= at_1["static-peak"]["slo_attainment"]


def test_the_progress_callback_and_an_unbinding_cap_leave_compare_s_results_unchanged():
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.4, 300))
    requests = [TraceRequest(float(t), 500, 100) for t in arrivals]
    model = ModelConfig(name="m", cold_start_seconds=30.0)
    kwargs = {"model": model, "policies": ["kpa", "oracle"], "slo_ttft_ms": 2000}
    seen = []
    plain = compare(requests, **kwargs)
    watched = compare(requests, **kwargs, max_replicas=10_000, on_policy=lambda *a: seen.append(a))
    # As JSON, where NaN (a share of no traffic: no reserved client here) equals itself.
    assert json.dumps(watched, sort_keys=True) == json.dumps(plain, sort_keys=True)
    assert seen == [("static-peak", 1, 3), ("kpa", 2, 3), ("oracle", 3, 3)]

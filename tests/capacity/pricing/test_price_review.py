"""Reviewed price changes (issue 21): a new fit that moves prices on last week's traffic by more
than COST_MODEL_MAX_AUTO_CHANGE_PERCENT waits for a planner as a candidate, with the reason and
the change stored; one within it activates itself and says why ("system:auto"); the change per
customer and per shape is what the currency's own code prices."""

import json
from pathlib import Path

import pytest

from benchmarking.services import benchmark_import, cost_model_fit
from capacity.pricing import review
from capacity.pricing.features import mu_coefficients
from capacity.repricing.services import cost_model_record
from core.models import AuditEntry
from tests.conftest import SIMPLE_WEIGHTS, make_cost_model
from tests.support.usage import replica_seconds, scaled

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

TABLE = (
    Path(__file__).resolve().parents[3]
    / "benchmarking"
    / "data"
    / "trtllm_llama31-8b_fp8_h100_tp1.csv"
)


def test_a_fit_30_percent_off_the_active_one_on_recent_traffic_is_not_activated(
    last_week, served_model, gpu_type
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))

    v2.refresh_from_db()
    last_week.refresh_from_db()
    assert (last_week.status, v2.status) == ("active", "candidate")
    assert v2.activated_at is None and v2.approved_by == ""
    assert v2.price_change["change"] == pytest.approx(0.30)
    assert v2.price_change["basis"] == "traffic"
    assert v2.price_change["requests"] == 20  # the refused request is not repriced
    assert v2.price_change["compared_with_version"] == 1
    # Totals, no customer's rows: only a customer over the per-customer limit is named, and
    # none had COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS (100) requests.
    assert "acme" not in json.dumps(v2.price_change) and "by_customer" not in v2.price_change
    assert v2.price_change["customers_over_limit"] == []
    assert v2.review_reason.startswith("Waits for a planner: v1 → v2 moves prices by +30.0 %")
    assert "more than COST_MODEL_MAX_AUTO_CHANGE_PERCENT (5 %)" in v2.review_reason
    held = AuditEntry.objects.get(action="cost_model.hold", object_id=str(v2.pk))
    assert held.actor == "system:auto"
    assert held.reason == v2.review_reason


def test_a_fit_within_the_threshold_activates_itself_and_says_why(
    last_week, served_model, gpu_type
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.03))

    assert v2.status == "active"
    assert v2.approved_by == "system:auto"
    assert v2.approval_reason == (
        "cross-validated MAPE 2.0 % is within COST_MODEL_MAX_ACTIVE_MAPE_PERCENT (10 %); "
        "v1 → v2 moves prices by +3.0 % on the last 7 days of traffic (20 requests of 2 "
        "customers), within COST_MODEL_MAX_AUTO_CHANGE_PERCENT (5 %); no customer had at least "
        "100 requests in the window; measured from v1, the active version and the first version "
        "in force in the last 30 days"
    )
    entry = AuditEntry.objects.get(action="cost_model.activate", object_id=str(v2.pk))
    assert (entry.actor, entry.reason) == ("system:auto", v2.approval_reason)
    assert entry.after["approved_by"] == "system:auto"


def test_the_threshold_is_a_setting(last_week, served_model, gpu_type, settings):
    settings.COST_MODEL_MAX_AUTO_CHANGE = 0.5
    assert make_cost_model(served_model, gpu_type, weights=scaled(1.3)).status == "active"
    settings.COST_MODEL_MAX_AUTO_CHANGE = 0.0  # any change at all waits (v2 is the active one)
    assert make_cost_model(served_model, gpu_type, weights=scaled(1.31)).status == "candidate"


def test_the_first_version_activates_itself_with_nothing_to_compare(served_model, gpu_type):
    v1 = make_cost_model(served_model, gpu_type)
    assert v1.status == "active"
    assert v1.price_change is None and v1.review_reason == ""
    assert v1.approved_by == "system:auto"
    assert "no version was active, so it reprices nothing" in v1.approval_reason


def test_the_change_is_shown_per_customer_and_per_shape_as_the_currency_prices_them(
    last_week, served_model, gpu_type
):
    doubled_output = scaled(1.0, output_tokens=2.0)
    v2 = make_cost_model(served_model, gpu_type, weights=doubled_output)
    assert v2.status == "candidate"

    change = review.price_change(candidate=v2, current=last_week)
    acme_before = 10 * replica_seconds(SIMPLE_WEIGHTS, 1000, 100) * 100 / 60
    acme_after = 10 * replica_seconds(doubled_output, 1000, 100) * 100 / 60
    globex_before = 10 * replica_seconds(SIMPLE_WEIGHTS, 4000, 20) * 100 / 60
    globex_after = 10 * replica_seconds(doubled_output, 4000, 20) * 100 / 60
    customers = {row.key: row for row in change.by_customer}
    assert list(customers) == ["globex", "acme"]  # the biggest charge first
    assert customers["acme"].current_mu == pytest.approx(acme_before)
    assert customers["acme"].candidate_mu == pytest.approx(acme_after)
    assert customers["acme"].change == pytest.approx(acme_after / acme_before - 1)  # +65.6 %
    assert customers["acme"].change_text == "+65.6 %"
    assert customers["globex"].change == pytest.approx(globex_after / globex_before - 1)  # +9.0 %
    assert (customers["acme"].requests, customers["globex"].label) == (10, "Globex")
    assert change.change == pytest.approx(
        (acme_after + globex_after) / (acme_before + globex_before) - 1
    )
    assert change.prices_usage is True
    shapes = {row.key: row for row in change.by_shape}
    assert set(shapes) == {"256–1k/64–256", "1k–4k/< 64"}  # 1000 in is under 1k = 1024
    assert shapes["256–1k/64–256"].change == pytest.approx(customers["acme"].change)
    assert shapes["1k–4k/< 64"].label == "input 1k–4k, output < 64 tokens"
    assert change.summary()["largest_customer_change"] == pytest.approx(customers["acme"].change)


def test_beyond_the_events_compared_a_sample_is_priced_and_said(
    last_week, served_model, gpu_type, monkeypatch
):
    monkeypatch.setattr(review, "MAX_EVENTS_COMPARED", 5)
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))
    change = review.price_change(candidate=v2, current=last_week)
    assert change.sample_one_in == 4  # 20 requests ran, at most 5 priced
    assert change.events_in_window == 20
    assert 0 < change.total.requests <= 10
    assert change.change == pytest.approx(0.30)  # every request moved by the same share
    assert "a one-in-4 sample of 20" in change.describe()


def test_without_traffic_the_benchmarks_own_shapes_are_compared_and_it_says_so():
    run, _ = benchmark_import(csv_text=TABLE.read_text(), model_name="llama-8b", gpu_name="H100")
    v1 = cost_model_fit(run=run)
    assert v1.status == "active"
    shapes = len(v1.residuals)
    weights = {name: weight * 1.2 for name, weight in v1.weights_replica_seconds.items()}
    v2 = make_cost_model(v1.served_model, v1.gpu_type, weights=weights)

    assert v2.status == "candidate"
    assert v2.price_change["basis"] == "benchmark_shapes"
    assert v2.price_change["change"] == pytest.approx(0.2)
    assert (
        f"+20.0 % on the benchmark's {shapes} shapes, each once (no traffic in the last 7 days)"
        in (v2.review_reason)
    )
    # Re-fitting the same table changes nothing, so it activates itself.
    assert cost_model_fit(run=run).status == "active"


def test_a_fit_above_the_mape_threshold_says_why_it_waits(last_week, served_model, gpu_type):
    poor = cost_model_record(
        served_model=served_model,
        gpu_type=gpu_type,
        gpus_per_replica=1,
        features=["input_tokens", "output_tokens", "request"],
        weights_replica_seconds=SIMPLE_WEIGHTS,
        mu_per_unit=mu_coefficients(SIMPLE_WEIGHTS),
        sample_count=10,
        distinct_shapes=10,
        cv_mape=0.25,
        cv_worst_error=0.4,
        candidates=[],
        residuals=[],
    )
    assert poor.status == "candidate"
    assert poor.review_reason == (
        "Waits for a planner: cross-validated MAPE 25.0 % is above "
        "COST_MODEL_MAX_ACTIVE_MAPE_PERCENT (10 %)."
    )
    assert poor.price_change["change"] == pytest.approx(0.0)


def test_fit_cost_model_says_why_a_fit_waits(tmp_path):
    import csv
    import io

    from django.core.management import call_command

    def run(*args) -> str:
        out = io.StringIO()
        call_command(*args, stdout=out)
        return out.getvalue()

    run("import_benchmark", str(TABLE), "--model", "m", "--gpu", "H100", "--fit")
    # The same engine 30 % slower: every shape takes 1.3 × the replica time.
    rows = list(csv.DictReader(TABLE.open()))
    for row in rows:
        row["requests_per_s"] = str(float(row["requests_per_s"]) / 1.3)
    slower = tmp_path / "slower.csv"
    with slower.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    run("import_benchmark", str(slower), "--model", "m", "--gpu", "H100")

    report = run("fit_cost_model", "--model", "m", "--gpu", "H100")

    assert "version 2, candidate" in report
    assert "Waits for a planner: v1 → v2 moves prices by +30.0 % on the benchmark's" in report

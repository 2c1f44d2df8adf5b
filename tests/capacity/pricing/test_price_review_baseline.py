"""Price review that cannot be ratcheted (issue 33). A new fit is measured against the review's
baseline, the last version a planner approved or the one in force 30 days ago, whichever came
into force later, as well as against the active version; and COST_MODEL_MAX_AUTO_CHANGE_PERCENT
limits each customer's charge on last week's traffic (customers with at least
COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS requests in it) as well as the total. All through the
services the nightly fit calls (benchmarking.services.cost_model_fit, cost_model_record) and
the API a planner approves with, on the real database."""

import csv
import io
from datetime import timedelta
from pathlib import Path

import pytest
import time_machine
from django.utils import timezone

from benchmarking.services import benchmark_import, cost_model_fit
from capacity.repricing.services import cost_model_activate
from core.models import AuditEntry
from tests.capacity.pricing.conftest import COST_MODELS, weights_moving
from tests.conftest import make_cost_model
from tests.support.factories import CustomerFactory
from tests.support.usage import post_usage, scaled

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

TABLE = (
    Path(__file__).resolve().parents[3]
    / "benchmarking"
    / "data"
    / "trtllm_llama31-8b_fp8_h100_tp1.csv"
)


def slower(factor: float) -> str:
    """The benchmark table of an engine `factor` × slower: every shape takes that much more
    replica time, so its fit prices every request `factor` × higher."""
    rows = list(csv.DictReader(io.StringIO(TABLE.read_text())))
    for row in rows:
        row["requests_per_s"] = str(float(row["requests_per_s"]) / factor)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def nightly_fit(factor: float):
    """What the nightly benchmark does once it measured: store the run, fit it."""
    run, _ = benchmark_import(csv_text=slower(factor), model_name="llama-8b", gpu_name="H100")
    return cost_model_fit(run=run)


def test_three_nightly_fits_of_4_percent_each_cannot_ratchet_past_the_limit():
    v1 = nightly_fit(1.0)
    assert v1.status == "active"

    v2 = nightly_fit(1.04)
    v3 = nightly_fit(1.04**2)
    v4 = nightly_fit(1.04**3)

    # +4 % from v1 is within 5 %; +8.2 % and +12.5 % from it are not, although each fit moves
    # prices by only 4 % from the one before.
    assert (v2.status, v3.status, v4.status) == ("active", "candidate", "candidate")
    assert v3.price_change["change"] == pytest.approx(0.04, abs=1e-3)  # from the active v2
    assert v3.price_change["compared_with_version"] == 2
    baseline = v3.price_change["baseline"]
    assert (baseline["kind"], baseline["version"], baseline["id"]) == (
        "first_in_force",
        1,
        v1.pk,
    )
    assert baseline["change"] == pytest.approx(1.04**2 - 1, abs=1e-3)
    assert baseline["description"] == "v1, the first version in force in the last 30 days"
    assert v3.review_reason.startswith(
        "Waits for a planner: v1 → v3 moves prices by +8.2 % on the benchmark's"
    )
    assert "more than COST_MODEL_MAX_AUTO_CHANGE_PERCENT (5 %)" in v3.review_reason
    assert "; from the active v2: +4.0 %, within it;" in v3.review_reason
    assert v3.review_reason.endswith(
        "measured from v1, the first version in force in the last 30 days."
    )
    assert v4.price_change["baseline"]["version"] == 1
    assert v4.price_change["baseline"]["change"] == pytest.approx(1.04**3 - 1, abs=1e-3)
    assert "v1 → v4 moves prices by +12.5 %" in v4.review_reason
    v2.refresh_from_db()
    assert v2.status == "active"  # what prices usage did not move past +4 %
    held = AuditEntry.objects.get(action="cost_model.hold", object_id=str(v3.pk))
    assert held.after["baseline_version"] == 1
    assert held.after["price_change_from_baseline"] == pytest.approx(1.04**2 - 1, abs=1e-3)


def test_a_fit_within_the_total_that_moves_customers_past_the_limit_waits_naming_them(
    last_week, served_model, gpu_type, settings
):
    settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = 10  # acme and globex sent 10 each
    moved = weights_moving(acme=1.25, globex=0.90)

    v2 = make_cost_model(served_model, gpu_type, weights=moved)

    assert v2.status == "candidate"
    # 10 × 3.05 s → 10 × 3.8125 s (acme) and 10 × 4.45 s → 10 × 4.005 s (globex): +4.2 %.
    assert v2.price_change["change"] == pytest.approx(78.175 / 75 - 1)
    # Both ways: globex's charge falling by 10 % is as much a price change as acme's rising.
    assert v2.price_change["customers_over_limit"] == [
        {
            "key": "acme",
            "label": "Acme",
            "requests": 10,
            "change": pytest.approx(0.25),
            "compared_with_version": 1,
        },
        {
            "key": "globex",
            "label": "Globex",
            "requests": 10,
            "change": pytest.approx(-0.10),
            "compared_with_version": 1,
        },
    ]
    assert v2.price_change["min_customer_requests"] == 10
    assert v2.review_reason == (
        "Waits for a planner: v1 → v2 moves prices by +4.2 % on the last 7 days of traffic "
        "(20 requests of 2 customers), within COST_MODEL_MAX_AUTO_CHANGE_PERCENT (5 %); "
        "acme's charge moves by +25.0 % (10 requests), globex's by -10.0 % (10 requests), "
        "more than it allows a customer with at least 10 requests in the window; measured "
        "from v1, the active version and the first version in force in the last 30 days."
    )
    held = AuditEntry.objects.get(action="cost_model.hold", object_id=str(v2.pk))
    assert held.after["customers_over_limit"] == ["acme", "globex"]
    last_week.refresh_from_db()
    assert last_week.status == "active"

    # The limit is for customers of at least that volume: above both, the same fit activates.
    settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = 11
    v3 = make_cost_model(served_model, gpu_type, weights=moved)
    assert v3.status == "active"
    assert v3.price_change["customers_over_limit"] == []
    assert "no customer had at least 11 requests in the window" in v3.approval_reason


def test_a_customer_below_the_minimum_volume_moving_50_percent_does_not_hold_a_fit(
    last_week, gateway, served_model, gpu_type, settings
):
    CustomerFactory(slug="initech", name="Initech")
    # Three tiny requests: 0.01 + 0.02 + 0.05 = 0.08 replica-seconds each, mostly the
    # per-request weight, which the fit below raises by 80 % (+0.04 s a request).
    post_usage(gateway, "initech", count=3, input_tokens=10, output_tokens=1)
    settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = 10
    dearer_requests = scaled(1.0, request=1.8)

    v2 = make_cost_model(served_model, gpu_type, weights=dearer_requests)

    assert v2.status == "active"  # acme +1.3 %, globex +0.9 %, in all +1.2 %
    assert v2.price_change["customers_over_limit"] == []
    assert v2.approval_reason.endswith(
        "within COST_MODEL_MAX_AUTO_CHANGE_PERCENT (5 %); every charge of a customer with at "
        "least 10 requests in the window is within it too; measured from v1, the active "
        "version and the first version in force in the last 30 days"
    )

    # Initech's charge did move by +50 %: counted, it holds the same fit.
    settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = 3
    v3 = make_cost_model(served_model, gpu_type, weights=dearer_requests)
    assert v3.status == "candidate"
    assert [row["key"] for row in v3.price_change["customers_over_limit"]] == ["initech"]
    assert v3.price_change["customers_over_limit"][0]["change"] == pytest.approx(0.5)
    assert "initech's charge moves by +50.0 % from v1 (3 requests)" in v3.review_reason


def test_a_planners_approval_through_the_api_resets_the_baseline(
    last_week, served_model, gpu_type, planner_client
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.04))
    v3 = make_cost_model(served_model, gpu_type, weights=scaled(1.04**2))
    assert (v2.status, v3.status) == ("active", "candidate")
    assert v3.price_change["baseline"]["version"] == 1

    response = planner_client.post(
        f"{COST_MODELS}{v3.pk}/activate/",
        {"reason": "the engine upgrade is slower, measured twice"},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["approved_by"] == "user:planner"

    v4 = make_cost_model(served_model, gpu_type, weights=scaled(1.04**3))
    assert v4.status == "active"  # +4 % from what the planner approved, +12.5 % from v1
    baseline = v4.price_change["baseline"]
    assert (baseline["kind"], baseline["version"], baseline["approved_by"]) == (
        "approved",
        3,
        "user:planner",
    )
    assert baseline["change"] == pytest.approx(0.04)
    v3.refresh_from_db()
    approved_on = v3.activated_at.strftime("%Y-%m-%d")
    assert (
        f"measured from v3, the active version and the last version a planner approved "
        f"(user:planner on {approved_on})"
    ) in v4.approval_reason
    assert "v3 → v4 moves prices by +4.0 % on the last 7 days of traffic" in v4.approval_reason

    # And the next step is measured from v3, not from v4 that activated itself.
    v5 = make_cost_model(served_model, gpu_type, weights=scaled(1.04**4))
    assert v5.status == "candidate"
    assert v5.price_change["baseline"]["version"] == 3
    assert "v3 → v5 moves prices by +8.2 %" in v5.review_reason
    stored = planner_client.get(f"{COST_MODELS}{v5.pk}/").json()
    assert (stored["status"], stored["price_change"]["baseline"]["version"]) == ("candidate", 3)
    assert stored["review_reason"] == v5.review_reason


def test_without_a_newer_approval_the_baseline_is_the_version_in_force_30_days_ago(
    served_model, gpu_type
):
    now = timezone.now()
    with time_machine.travel(now - timedelta(days=40), tick=False):
        v1 = make_cost_model(served_model, gpu_type)
    with time_machine.travel(now - timedelta(days=35), tick=False):
        v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.04))
    assert (v1.status, v2.status) == ("active", "active")

    # v2 was in force 30 days ago: v1's prices are history, and the limit counts from v2.
    v3 = make_cost_model(served_model, gpu_type, weights=scaled(1.04**2))
    assert v3.status == "active"
    assert v3.price_change["baseline"]["kind"] == "active_30_days_ago"
    assert v3.price_change["baseline"]["version"] == 2

    v4 = make_cost_model(served_model, gpu_type, weights=scaled(1.04**3))
    assert v4.status == "candidate"
    assert (v4.price_change["baseline"]["kind"], v4.price_change["baseline"]["version"]) == (
        "active_30_days_ago",
        2,
    )
    assert v4.review_reason.startswith("Waits for a planner: v2 → v4 moves prices by +8.2 %")
    assert "measured from v2, the version in force 30 days ago" in v4.review_reason


def test_an_approval_older_than_the_version_in_force_30_days_ago_gives_way_to_it(
    served_model, gpu_type
):
    now = timezone.now()
    with time_machine.travel(now - timedelta(days=61), tick=False):
        make_cost_model(served_model, gpu_type)
    with time_machine.travel(now - timedelta(days=60), tick=False):
        v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))
        assert v2.status == "candidate"
        cost_model_activate(cost_model=v2, actor="user:planner", reason="new engine build")
    with time_machine.travel(now - timedelta(days=40), tick=False):
        v3 = make_cost_model(served_model, gpu_type, weights=scaled(1.3 * 1.04))
    assert v3.status == "active"
    assert (v3.price_change["baseline"]["kind"], v3.price_change["baseline"]["version"]) == (
        "approved",
        2,
    )

    # Now the approval (60 days ago) is older than v3's coming into force (40 days ago).
    v4 = make_cost_model(served_model, gpu_type, weights=scaled(1.3 * 1.04**2))
    assert v4.status == "active"
    assert (v4.price_change["baseline"]["kind"], v4.price_change["baseline"]["version"]) == (
        "active_30_days_ago",
        3,
    )
    v5 = make_cost_model(served_model, gpu_type, weights=scaled(1.3 * 1.04**3))
    assert v5.status == "candidate"
    assert v5.price_change["baseline"]["version"] == 3
    assert v5.price_change["baseline"]["change"] == pytest.approx(1.04**2 - 1)


def test_a_fit_is_measured_against_the_active_version_as_well_as_the_baseline(
    last_week, served_model, gpu_type
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.04))
    assert v2.status == "active"

    # −3 % from the baseline v1, but −6.7 % from v2, whose prices customers pay today.
    v3 = make_cost_model(served_model, gpu_type, weights=scaled(0.97))

    assert v3.status == "candidate"
    assert v3.price_change["change"] == pytest.approx(0.97 / 1.04 - 1)
    assert v3.price_change["baseline"]["change"] == pytest.approx(-0.03)
    assert v3.review_reason == (
        "Waits for a planner: v1 → v3 moves prices by -3.0 % on the last 7 days of traffic "
        "(20 requests of 2 customers), within COST_MODEL_MAX_AUTO_CHANGE_PERCENT (5 %); from "
        "the active v2: -6.7 %, more than it; no customer had at least 100 requests in the "
        "window; measured from v1, the first version in force in the last 30 days."
    )


def test_a_reason_naming_many_customers_names_fewer_rather_than_lose_its_baseline(
    last_week, gateway, served_model, gpu_type, settings
):
    settings.COST_MODEL_REVIEW_MIN_CUSTOMER_REQUESTS = 10
    slugs = [f"a-customer-with-a-rather-long-name-{n}" for n in range(5)]
    for slug in slugs:
        CustomerFactory(slug=slug, name=slug.title())
        post_usage(gateway, slug, count=10, input_tokens=1000, output_tokens=100)  # as acme

    v2 = make_cost_model(served_model, gpu_type, weights=weights_moving(acme=1.25, globex=0.9))

    assert v2.status == "candidate"
    over = v2.price_change["customers_over_limit"]
    # The largest change first (+25 %, by slug on a tie), then globex's -10 %.
    assert [row["key"] for row in over] == [*slugs, "acme", "globex"]
    assert len(v2.review_reason) <= 500
    assert v2.review_reason.endswith(
        "measured from v1, the active version and the first version in force in the last 30 days."
    )
    assert (
        "; a-customer-with-a-rather-long-name-0's charge moves by +25.0 % (10 requests), "
        "a-customer-with-a-rather-long-name-1's by +25.0 % (10 requests), and those of 5 more "
        "customers, more than it allows a customer with at least 10 requests in the window;"
    ) in v2.review_reason

"""A planner follows benchmarks in a real browser: a running run turns succeeded on the list
without a reload, the run's page shows its samples, and the cost model page draws the fit."""

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from benchmarking import services
from benchmarking.models import BenchmarkRun
from benchmarking.references import deployment_suite_set
from tests.planner.test_benchmarks_pages import GRID, measured_run
from tests.support.browser import log_in, screenshot
from tests.support.factories import (
    DeploymentFactory,
    GpuPoolFactory,
    GpuTypeFactory,
    ServedModelFactory,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_planner_watches_a_run_and_reads_the_fit_of_its_cost_model(site, page, planner_user):
    log_in(page, site, "pat")
    page.goto(site + "/planner/benchmarks/")
    expect(page.get_by_text("No benchmark runs yet.")).to_be_visible()
    screenshot(page, "runs-empty")
    page.get_by_role("tablist", name="Benchmarks").get_by_role("link", name="Cost models").click()
    expect(page.get_by_text("No cost models yet.")).to_be_visible()
    screenshot(page, "cost-models-empty")

    gpu_type = GpuTypeFactory(name="H100-80GB")
    served_model = ServedModelFactory(name="llama-3-1-8b", reference_gpu_type=gpu_type)
    deployment = DeploymentFactory(
        name="llama-8b-h100",
        served_model=served_model,
        gpu_pool=GpuPoolFactory(name="us-east-h100", gpu_type=gpu_type),
        endpoint_url="http://127.0.0.1:8101",
    )
    suite = services.suite_create(
        name="quick", grid=[[128, 16], [512, 64]], slo_ttft_p95_ms=2000, slo_tpot_p95_ms=200
    )
    canary = DeploymentFactory(
        name="llama-8b-h100-canary", served_model=served_model, gpu_pool=deployment.gpu_pool
    )
    deployment_suite_set(deployment=canary, suite=suite)
    older = measured_run(
        served_model, gpu_type, noise=[0.06, -0.05, 0.04, -0.06, 0.05, -0.04, 0.02, 0.05]
    )
    services.cost_model_fit(run=older)
    fitted = measured_run(served_model, gpu_type, deployment=deployment)
    cost_model = services.cost_model_fit(run=fitted)
    running = measured_run(
        served_model, gpu_type, deployment=deployment, status=BenchmarkRun.Status.RUNNING
    )
    sustainable = len(GRID)

    page.goto(site + "/planner/benchmarks/")
    expect(page.get_by_role("heading", name="Benchmarks")).to_be_visible()
    row = page.locator(f"#run-{running.pk}")
    expect(row.locator(".badge")).to_have_text("Running")
    expect(page.locator("#runs-table")).to_have_attribute("hx-trigger", "every 2s")
    screenshot(page, "runs")

    # The worker finishes the run: the list shows it within a poll, then stops polling.
    BenchmarkRun.objects.filter(pk=running.pk).update(
        status=BenchmarkRun.Status.SUCCEEDED,
        progress_done=len(GRID),
        progress_message="measured every shape",
        finished_at=timezone.now(),
    )
    expect(row.locator(".badge")).to_have_text("Succeeded", timeout=10_000)
    expect(row).to_contain_text(f"{len(GRID)}/{len(GRID)}")
    assert page.locator("#runs-table").get_attribute("hx-trigger") is None
    screenshot(page, "runs-finished")

    page.get_by_role("link", name=f"Run {fitted.pk}", exact=True).click()
    expect(page.get_by_role("heading", name=f"Run {fitted.pk}: llama-3-1-8b")).to_be_visible()
    expect(page.locator("table.samples tbody tr")).to_have_count(2 * len(GRID))
    expect(page.locator("pre.log")).to_contain_text("line 119")
    screenshot(page, "run")

    page.get_by_role("link", name=f"Version {cost_model.version}").click()
    page.wait_for_load_state("networkidle")
    expect(page.get_by_role("heading", name="Fit: predicted against measured")).to_be_visible()
    canvas = page.locator("canvas#fit-chart")
    expect(canvas).to_be_visible()
    page.wait_for_function("() => !!Chart.getChart(document.getElementById('fit-chart'))")
    drawn = page.evaluate(
        """() => {
            const chart = Chart.getChart(document.getElementById('fit-chart'));
            const points = chart.getDatasetMeta(0);
            return {
                points: chart.data.datasets[0].data.length,
                drawn: points.data.filter((p) => isFinite(p.x) && isFinite(p.y)).length,
                xScale: chart.scales.x.type,
                width: chart.width,
            };
        }"""
    )
    assert drawn["points"] == sustainable
    assert drawn["drawn"] == sustainable
    assert drawn["xScale"] == "logarithmic"
    assert drawn["width"] > 300
    # The coefficient history of both versions is drawn too.
    assert (
        page.evaluate(
            "() => Chart.getChart(document.querySelector("
            "'canvas[data-chart=\"history-chart-config\"]')).data.labels.length"
        )
        == 2
    )
    screenshot(page, "cost-model")

    # Make the older version active again: the page says so and shows it active.
    page.get_by_role("button", name="Activate v1").click()
    expect(page.locator(".messages li.success")).to_contain_text("v1 is active")
    expect(page.locator("#version-1 .badge")).to_have_text("Active")
    expect(page.locator("#version-2 .badge")).to_have_text("Retired")
    screenshot(page, "cost-model-activated")

    # Run now on a deployment without an endpoint: the service's reason, not an error page.
    page.locator("select#id_deployment").select_option(
        label="llama-8b-h100-canary (quick; no endpoint)"
    )
    page.get_by_role("button", name="Run now").click()
    expect(page.locator(".messages li.error")).to_contain_text(
        "Run not queued: Nothing to benchmark: the deployment has no endpoint_url"
    )
    assert BenchmarkRun.objects.count() == 3
    screenshot(page, "run-now-refused")

    page.get_by_role("tablist", name="Benchmarks").get_by_role("link", name="Cost models").click()
    expect(page.get_by_role("heading", name="Cost models")).to_be_visible()
    expect(page.get_by_role("link", name="llama-3-1-8b")).to_be_visible()
    screenshot(page, "cost-models")

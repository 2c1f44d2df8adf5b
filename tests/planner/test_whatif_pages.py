"""The What-if pages with Django's test client: what a planner reads on an empty database, form
errors next to the field, a queued run in the list, the comparison table of a finished run,
the polling fragment, and a list whose query count does not grow with its rows."""

import html as htmllib
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from simulation import whatif
from simulation.models import WhatIfRun
from tests.support.factories import ServedModelFactory

pytestmark = pytest.mark.django_db

INDEX = reverse("planner:whatif:index")
FORM = {
    "trace": "azure-conv",
    "duration_minutes": "3",
    "rate_scale": "1",
    "reservations": "",
    "overcommit": "1",
    "target_utilisation": "0.8",
    "cold_start_seconds": "",
    "slo_ttft_ms": "2000",
    "slo_goal": "0.99",
    "tick_seconds": "15",
    "policies": ["static-peak", "kpa"],
}


def text(response) -> str:
    """The page's text without tags, whitespace collapsed."""
    plain = re.sub(r"<[^>]+>", " ", response.content.decode())
    return re.sub(r"\s+", " ", htmllib.unescape(plain))


def test_the_empty_page_says_what_to_do(planner_client):
    response = planner_client.get(INDEX)
    assert response.status_code == 200
    page = text(response)
    assert "No served models yet." in page
    assert "the built-in profile" in page
    assert "No what-ifs yet." in page
    assert "Run the what-if" in page
    # Every bundled trace is offered, the conversation trace first.
    for label in [t.label for t in whatif.BUNDLED_TRACES.values()]:
        assert label in page


def test_a_non_planner_sees_nothing(member_client, client):
    assert member_client.get(INDEX).status_code == 403
    assert client.get(INDEX).status_code == 302


FORM_ERRORS = [
    ({"reservations": "acme = 10\nglobex: 5"}, "reservations", "line 2: expected"),
    ({"target_utilisation": "2"}, "target_utilisation", "must be &gt; 0 and ≤ 1"),
    ({"overcommit": "many"}, "overcommit", "Enter a number."),
    ({"policies": ["psychic"]}, "policies", "Select a valid choice"),
    ({"model_config": '{"name": "x", "max_num_seqs": "lots"}'}, "model_config", "max_num_seqs"),
    ({"trace": "azure-chat"}, "trace", "Select a valid choice"),
    (
        {"trace_file": b"timestamp,input_tokens,output_tokens\n5,1\n"},
        "trace_file",
        "bad.csv line 2: expected 3 values, got 2",
    ),
]


def test_a_form_error_is_shown_next_to_its_field(planner_client):
    # One test for all cases: the planner fixture's password hashing dominates a setup.
    for change, field, message in FORM_ERRORS:
        if "trace_file" in change:
            change = {"trace_file": SimpleUploadedFile("bad.csv", change["trace_file"])}
        response = planner_client.post(INDEX, FORM | change)
        assert response.status_code == 400, field
        html = response.content.decode()
        assert "The what-if was not started." in html
        # The error list sits in the field's own block, which is marked invalid.
        block = re.search(
            rf'<div class="field[^"]*" data-field="{field}">(?:(?!<div class="field).)*', html, re.S
        )
        assert block, (field, html[:2000])
        assert "invalid" in block.group(0).split(">", 1)[0], field
        assert 'class="errorlist' in block.group(0), field
        assert message in block.group(0), (field, block.group(0))
    assert not WhatIfRun.objects.exists()


def test_a_created_run_opens_its_page_and_appears_in_the_list(planner_client, planner):
    served_model = ServedModelFactory(name="llama-70b")
    upload = SimpleUploadedFile(
        "mine.csv", b"timestamp,input_tokens,output_tokens\n0,100,10\n1.5,200,20\n3,300,30\n"
    )
    # Filed under the model, with a replica of its own (the model has no fleet to simulate).
    form = FORM | {
        "served_model": str(served_model.pk),
        "trace_file": upload,
        "model_config": '{"name": "70b", "max_num_seqs": 128}',
    }
    response = planner_client.post(INDEX, form)
    run = WhatIfRun.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("planner:whatif:detail", args=[run.pk])
    assert run.trace_filename == "mine.csv" and run.trace_name == ""
    assert run.requested_by == planner and run.served_model == served_model

    detail = planner_client.get(response["Location"])
    page = text(detail)
    assert "Queued" in page and "0 of 2 policies simulated" in page
    assert 'hx-trigger="every 2s"' in detail.content.decode()
    assert "uploaded mine.csv" in page

    listing = text(planner_client.get(INDEX))
    assert "No what-ifs yet." not in listing
    assert f"{run.pk} " in listing and "llama-70b" in listing and "mine.csv" in listing


def test_a_models_selling_prefills_the_form(planner_client, acme, served_model):
    from datetime import timedelta

    from django.utils import timezone

    from capacity.models import Reservation

    served_model.overcommit = 1.5
    served_model.save()
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=120,
        starts_at=timezone.now() - timedelta(days=1),
        status=Reservation.Status.ACTIVE,
    )
    html = planner_client.get(INDEX + f"?model={served_model.pk}").content.decode()
    assert "acme = 120</textarea>" in html
    assert 'name="overcommit" value="1.5"' in html


def test_a_finished_run_shows_the_comparison_with_the_best_policy(planner_client):
    run = whatif.whatif_create(
        trace_name="azure-conv",
        duration_minutes=3,
        policies=["kpa", "hpa-rps", "oracle"],
        reservations="default = 150",
        overcommit=1.5,
    )
    whatif.whatif_execute(run.pk)
    run.refresh_from_db()
    response = planner_client.get(reverse("planner:whatif:detail", args=[run.pk]))
    html = response.content.decode()
    page = text(response)
    assert "Comparison" in page and "Succeeded" in page
    assert 'hx-trigger="every 2s"' not in html  # finished: no more polling
    rows = re.findall(r'<tr[^>]*data-policy="([^"]+)"', html)
    assert rows == ["static-peak", "kpa", "hpa-rps", "oracle"]
    for heading in ["GPU-hours", "Savings vs static-peak", "SLO attainment", "TTFT p99 (ms)"]:
        assert heading in page
    best = whatif.best_policy(run)
    if best:
        assert re.search(rf'<tr class="best" data-policy="{best}"', html)
        assert f"Best at the SLO: {best}" in page
    else:
        assert "No policy met the SLO" in page
    assert "Keep warm no" in page
    # The settings used, with the fleet cap the overcommit gave.
    assert "capped at 1 replica = ceil(150 ÷ 1.50 ÷ 100 MU/min per replica)" in page
    # The polling fragment now carries the table and no trigger.
    fragment = planner_client.get(reverse("planner:whatif:progress", args=[run.pk]))
    assert fragment.status_code == 200
    assert "<html" not in fragment.content.decode()
    assert 'data-policy="kpa"' in fragment.content.decode()
    assert "hx-trigger" not in fragment.content.decode()


def test_a_failed_run_says_why(planner_client):
    run = whatif.whatif_create(trace_name="azure-code", duration_minutes=2, policies=["kpa"])
    WhatIfRun.objects.filter(pk=run.pk).update(trace_name="retired-trace")
    whatif.whatif_execute(run.pk)
    page = text(planner_client.get(reverse("planner:whatif:detail", args=[run.pk])))
    assert "Failed" in page and "The simulation did not finish." in page
    assert "retired-trace" in page


def test_an_unknown_run_is_a_404(planner_client):
    assert planner_client.get(reverse("planner:whatif:detail", args=[999])).status_code == 404
    assert planner_client.get(reverse("planner:whatif:progress", args=[999])).status_code == 404


def _grow(count: int) -> None:
    for index in range(count):
        WhatIfRun.objects.create(
            # No password: hashing one per row would make this the slowest test here.
            requested_by=get_user_model().objects.create(username=f"asker-{count}-{index}"),
            served_model=ServedModelFactory(),
            trace_name="azure-conv",
            settings={"duration_minutes": 5, "overcommit": 1.0, "reservations": {"a": 10}},
            status=WhatIfRun.Status.SUCCEEDED if index % 2 else WhatIfRun.Status.RUNNING,
            result={
                "policies": {
                    "static-peak": {
                        "gpu_hours": 1.0,
                        "slo_attainment": 1.0,
                        "guaranteed_refused": 0,
                    }
                }
            },
        )


def queries_for(client, path: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200
    return len(captured)


def test_the_list_does_not_grow_queries_with_its_rows(planner_client):
    _grow(2)
    few = queries_for(planner_client, INDEX)
    _grow(8)
    many = queries_for(planner_client, INDEX)
    assert many == few
    assert text(planner_client.get(INDEX)).count("static-peak") >= 5  # best policies listed


def test_a_models_fleet_prefills_the_form_and_its_run_shows_the_fleet_and_the_refusals(
    planner_client, served_model, sellable, acme
):
    from datetime import timedelta

    from django.utils import timezone

    from capacity.models import Deployment, Reservation

    deployment = Deployment.objects.get()
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=60,
        starts_at=timezone.now() - timedelta(days=1),
        status=Reservation.Status.ACTIVE,
    )
    html = planner_client.get(INDEX + f"?model={served_model.pk}").content.decode()
    assert re.search(rf'<option value="{deployment.pk}" selected>llama-8b-h100 \(', html)
    assert "acme = 60</textarea>" in html
    assert "This model&#x27;s own usage" in html

    form = FORM | {
        "served_model": str(served_model.pk),
        "deployment": str(deployment.pk),
        "reservations": "default = 60",
        "policies": ["static-peak", "modelunit"],
    }
    response = planner_client.post(INDEX, form)
    assert response.status_code == 302, text(response)[:3000]
    run = WhatIfRun.objects.get()
    whatif.whatif_execute(run.pk)
    page = text(planner_client.get(response["Location"]))
    assert "Fleet deployment llama-8b-h100 on H100-80GB×1 (pool us-east-h100, 8 GPUs)" in page
    assert "Replica from cost model H100-80GB×1 v1" in page
    assert "100.0 MU/min saturated" in page
    for heading in ["Refused: guaranteed", "Refused: best-effort", "SLO: admitted guaranteed"]:
        assert heading in page
    # 'default' holds the reservation: every request is guaranteed traffic, none best-effort.
    assert re.search(r"modelunit(?: best)? [\d.,]+ [-\d.]+% [\d.]+% [\d.]+% — [\d.]+%", page), page


def test_a_model_without_a_cost_model_is_a_form_error_on_the_model(planner_client):
    served_model = ServedModelFactory(name="unpriced")
    response = planner_client.post(INDEX, FORM | {"served_model": str(served_model.pk)})
    assert response.status_code == 400
    block = re.search(
        r'<div class="field[^"]*" data-field="served_model">(?:(?!<div class="field).)*',
        response.content.decode(),
        re.S,
    )
    assert "no active cost model on its reference GPU type" in htmllib.unescape(block.group(0))
    assert not WhatIfRun.objects.exists()


@pytest.mark.both_databases
def test_a_models_what_if_page_shows_every_deployment_and_its_share(
    planner_client, served_model, pool, gpu_type
):
    from tests.conftest import make_cost_model
    from tests.support.factories import DeploymentFactory, GpuPoolFactory, GpuTypeFactory

    DeploymentFactory(name="llama-8b-h100", served_model=served_model, gpu_pool=pool)
    make_cost_model(served_model, gpu_type)
    l40s = GpuTypeFactory(name="L40S-48GB", hourly_cost_usd="1.0000")
    l40s_pool = GpuPoolFactory(name="eu-l40s", gpu_type=l40s, gpu_count=4)
    DeploymentFactory(
        name="llama-8b-l40s",
        served_model=served_model,
        gpu_pool=l40s_pool,
        gpus_per_replica=2,
        max_replicas=2,
    )
    make_cost_model(served_model, l40s, gpus_per_replica=2)
    # Another model on the L40S pool: the page says its GPUs are not held back for it.
    DeploymentFactory(
        name="mistral-l40s",
        served_model__name="mistral-7b",
        gpu_pool=l40s_pool,
    )
    # A model of two deployments: the form starts from the whole model, not one deployment.
    html = planner_client.get(INDEX + f"?model={served_model.pk}").content.decode()
    assert re.search(r'<option value="" selected>\(every deployment of the model\)', html)

    response = planner_client.post(
        INDEX, FORM | {"served_model": str(served_model.pk), "rate_scale": "4"}
    )
    assert response.status_code == 302, text(response)[:3000]
    run = WhatIfRun.objects.get()
    whatif.whatif_execute(run.pk)
    detail = planner_client.get(response["Location"])
    page = text(detail)
    assert "llama-8b-h100 on H100-80GB×1 (pool us-east-h100, 8 GPUs)" in page
    assert "llama-8b-l40s on L40S-48GB×2 (pool eu-l40s, 4 GPUs)" in page
    assert "2 deployments, 12 GPUs in 2 pools" in page
    assert "Pool eu-l40s also runs other models' deployments (mistral-l40s)" in page
    # Per policy, each deployment's share and the model's totals.
    html = detail.content.decode()
    for policy in ("static-peak", "kpa"):
        for name in ("llama-8b-h100", "llama-8b-l40s", "model total"):
            assert re.search(rf'<tr data-policy="{policy}" data-deployment="{name}">', html), (
                policy,
                name,
            )
    run.refresh_from_db()
    cost = run.result["deployments"]["static-peak"]["llama-8b-l40s"]["cost_usd"]
    row = re.search(
        r'<tr data-policy="static-peak" data-deployment="llama-8b-l40s">(.*?)</tr>', html, re.S
    ).group(1)
    assert f"${cost:,.2f}" in row
    total = re.search(
        r'<tr data-policy="static-peak" data-deployment="model total">(.*?)</tr>', html, re.S
    ).group(1)
    assert f"${run.result['policies']['static-peak']['cost_usd']:,.2f}" in total

"""Schedules follow the flag (issue 21): setting or clearing a deployment's `benchmark_nightly`,
or changing its `benchmark_hour_utc`, updates its beat row in the same transaction, through
the API and the admin alike; a rolled-back write leaves the row as it was."""

import json

import pytest
from django.core.management import call_command
from django.db import transaction
from django.urls import reverse
from django_celery_beat.models import PeriodicTask, PeriodicTasks

from benchmarking.references import deployment_suite_set
from benchmarking.services import suite_create
from capacity.catalog.services import deployment_update
from core.errors import DomainError

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

DEPLOYMENTS = "/api/v1/deployments/"


@pytest.fixture
def suite(db):
    return suite_create(name="nightly", grid=[[128, 16]], slo_ttft_p95_ms=1000, slo_tpot_p95_ms=100)


def nightly_rows():
    return PeriodicTask.objects.filter(task="benchmarking.benchmark_deployment")


def the_row(deployment) -> PeriodicTask:
    (row,) = nightly_rows()
    assert row.args == json.dumps([deployment.pk])
    return row


def patch(client, deployment, **changes):
    return client.patch(f"{DEPLOYMENTS}{deployment.name}/", changes, format="json")


def test_ticking_the_flag_schedules_the_run_at_the_deployments_hour(
    planner_client, deployment, suite
):
    assert not nightly_rows().exists()
    changed_before = PeriodicTasks.last_change()

    response = patch(planner_client, deployment, benchmark_suite="nightly", benchmark_nightly=True)

    assert response.status_code == 200, response.json()
    assert response.json()["benchmark_hour_utc"] == 2
    row = the_row(deployment)
    assert (row.name, row.enabled, row.queue) == (
        "nightly benchmark: llama-8b-h100",
        True,
        "benchmarks",
    )
    assert (row.crontab.minute, row.crontab.hour, str(row.crontab.timezone)) == ("0", "2", "UTC")
    assert row.interval is None
    # Beat's scheduler reloads only when this marker moves: the row was saved, not bulk-updated.
    assert PeriodicTasks.last_change() != changed_before


def test_changing_the_hour_moves_the_crontab_of_the_same_row(planner_client, deployment, suite):
    patch(planner_client, deployment, benchmark_suite="nightly", benchmark_nightly=True)
    first = the_row(deployment)

    response = patch(planner_client, deployment, benchmark_hour_utc=17)

    assert response.status_code == 200, response.json()
    row = the_row(deployment)
    assert row.pk == first.pk
    assert (row.crontab.hour, row.crontab.minute, row.enabled) == ("17", "0", True)


def test_clearing_the_flag_disables_the_row(planner_client, deployment, suite):
    patch(planner_client, deployment, benchmark_suite="nightly", benchmark_nightly=True)
    response = patch(planner_client, deployment, benchmark_nightly=False)
    assert response.status_code == 200, response.json()
    assert the_row(deployment).enabled is False

    patch(planner_client, deployment, benchmark_nightly=True)
    assert the_row(deployment).enabled is True


def test_a_deployment_created_with_the_flag_has_its_row(planner_client, pool, served_model, suite):
    response = planner_client.post(
        DEPLOYMENTS,
        {
            "name": "nightly-one",
            "served_model": served_model.name,
            "gpu_pool": pool.name,
            "benchmark_suite": "nightly",
            "benchmark_nightly": True,
            "benchmark_hour_utc": 23,
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    (row,) = nightly_rows()
    assert (row.name, row.crontab.hour, row.enabled) == (
        "nightly benchmark: nightly-one",
        "23",
        True,
    )


def test_a_flag_without_a_suite_or_an_hour_off_the_clock_is_a_400_and_writes_nothing(
    planner_client, deployment, suite
):
    response = patch(planner_client, deployment, benchmark_nightly=True)
    assert response.status_code == 400
    assert "benchmark_nightly" in response.json()["error"]["fields"]
    assert "needs a benchmark_suite" in response.json()["error"]["message"]

    response = patch(
        planner_client, deployment, benchmark_suite="nightly", benchmark_nightly=True,
        benchmark_hour_utc=24,
    )  # fmt: skip
    assert response.status_code == 400
    assert "benchmark_hour_utc" in response.json()["error"]["fields"]
    assert not nightly_rows().exists()
    deployment.refresh_from_db()
    assert deployment.benchmark_nightly is False


def test_a_rolled_back_write_leaves_the_row_as_it_was(deployment, suite):
    with pytest.raises(RuntimeError), transaction.atomic():
        deployment_update(deployment=deployment, benchmark_suite=suite, benchmark_nightly=True)
        assert the_row(deployment).enabled  # written in the write's own transaction ...
        raise RuntimeError("what follows the write fails")
    assert not nightly_rows().exists()  # ... so it goes with it

    deployment_update(deployment=deployment, benchmark_suite=suite, benchmark_nightly=True)
    with pytest.raises(RuntimeError), transaction.atomic():
        deployment_update(deployment=deployment, benchmark_hour_utc=9, benchmark_nightly=False)
        raise RuntimeError("rolled back")
    row = the_row(deployment)
    assert (row.crontab.hour, row.enabled) == ("2", True)

    # A write the service refuses changes neither the deployment nor its row.
    with pytest.raises(DomainError, match="exceeds pool"):
        deployment_update(deployment=deployment, benchmark_hour_utc=9, max_replicas=99)
    row = the_row(deployment)
    assert row.crontab.hour == "2"


def test_a_renamed_deployment_keeps_one_row_and_a_deleted_one_has_none(
    planner_client, deployment, suite
):
    patch(planner_client, deployment, benchmark_suite="nightly", benchmark_nightly=True)
    first = the_row(deployment)
    response = patch(planner_client, deployment, name="renamed")
    assert response.status_code == 200, response.json()
    deployment.refresh_from_db()
    row = the_row(deployment)
    assert (row.pk, row.name) == (first.pk, "nightly benchmark: renamed")

    assert planner_client.delete(f"{DEPLOYMENTS}renamed/").status_code == 204
    assert not nightly_rows().exists()


def test_the_admin_writes_the_row_with_the_deployment(client, django_user_model, deployment, suite):
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    url = reverse("admin:capacity_deployment_change", args=[deployment.pk])
    form = {
        "name": deployment.name,
        "served_model": deployment.served_model_id,
        "gpu_pool": deployment.gpu_pool_id,
        "gpus_per_replica": 1,
        "min_replicas": 0,
        "max_replicas": 4,
        "current_replicas": 0,
        "cold_start_seconds": 120,
        "target_utilisation": 0.8,
        "actuator_kind": "dry_run",
        "actuator_config": "{}",
        "engine_profile": "{}",
        "benchmark_suite": suite.pk,
        "benchmark_nightly": "on",
        "benchmark_hour_utc": 4,
    }
    assert "benchmark_hour_utc" in client.get(url).content.decode()
    assert client.post(url, form).status_code == 302
    row = the_row(deployment)
    assert (row.crontab.hour, row.enabled) == ("4", True)

    refused = client.post(url, form | {"benchmark_suite": "", "benchmark_hour_utc": 5})
    assert refused.status_code == 200  # the form again, with the error
    assert "benchmark_nightly needs a benchmark_suite" in refused.content.decode()
    assert the_row(deployment).crontab.hour == "4"

    form.pop("benchmark_nightly")  # an unticked checkbox is not sent
    assert client.post(url, form).status_code == 302
    assert the_row(deployment).enabled is False

    delete = reverse("admin:capacity_deployment_delete", args=[deployment.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 302
    assert not nightly_rows().exists()


def test_setup_periodic_tasks_writes_every_deployments_row_as_it_says(deployment, suite):
    from capacity.models import Deployment

    # A row written before rows followed the flag, for a deployment that has since stopped.
    Deployment.objects.filter(pk=deployment.pk).update(benchmark_nightly=True, benchmark_hour_utc=6)
    deployment_suite_set(deployment=deployment, suite=suite)
    call_command("setup_periodic_tasks")
    call_command("setup_periodic_tasks")
    row = the_row(deployment)
    assert (row.crontab.hour, row.enabled) == ("6", True)
    Deployment.objects.filter(pk=deployment.pk).update(benchmark_nightly=False)
    call_command("setup_periodic_tasks")
    assert the_row(deployment).enabled is False


def test_a_suite_that_does_not_exist_is_refused_and_a_change_of_suite_is_audited(
    planner_client, deployment, suite
):
    from core.models import AuditEntry

    refused = patch(planner_client, deployment, benchmark_suite="no-such-suite")
    assert refused.status_code == 400
    assert "benchmark_suite" in refused.content.decode()
    deployment.refresh_from_db()
    assert deployment.benchmark_suite is None

    assert patch(planner_client, deployment, benchmark_suite="nightly").status_code == 200
    assert patch(planner_client, deployment, benchmark_suite=None).status_code == 200
    changes = [
        (entry.before["benchmark_suite"], entry.after["benchmark_suite"])
        for entry in AuditEntry.objects.filter(
            action="deployment.update", object_id=str(deployment.pk)
        ).order_by("at", "pk")
    ]
    assert changes == [(None, suite.pk), (suite.pk, None)]
    assert planner_client.get(f"{DEPLOYMENTS}{deployment.name}/").json()["benchmark_suite"] is None

"""Migrations 0023 and 0024 (issue 21) on stored data: versions activated before approvals were
kept learn their approver from the audit log; deployments take the hour their nightly beat row
ran at (a planner may have edited it in the admin)."""

import json
from datetime import UTC, datetime

import pytest
from django_celery_beat.models import CrontabSchedule, PeriodicTask

from tests.support.factories import GpuPoolFactory
from tests.support.migrations import migrate_to, old_served_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_databases]


def test_activated_versions_take_their_approver_from_the_audit_log(back_to_the_leaf):
    old = migrate_to([("capacity", "0022_kserve_configs_use_their_own_kind")])
    CostModel = old.get_model("capacity", "CostModel")
    AuditEntry = old.get_model("controlplane", "AuditEntry")
    pool = GpuPoolFactory()
    served_model = old_served_model(old, pool.gpu_type_id)
    when = datetime(2026, 11, 1, tzinfo=UTC)

    def version(number, status, activated_at):
        return CostModel.objects.create(
            served_model_id=served_model.pk, gpu_type_id=pool.gpu_type_id, version=number,
            features=["request"], weights_replica_seconds={"request": 0.05},
            alpha_mu_per_input_token=0, beta_mu_per_output_token=0, gamma_mu_per_request=0.08,
            mu_per_unit={}, sample_count=6, distinct_shapes=6, cv_mape=0.02,
            cv_worst_error=0.05, status=status, activated_at=activated_at,
        )  # fmt: skip

    audited = version(1, "retired", when)
    for actor, reason in (("system:auto", "MAPE 2 %"), ("user:alice", "back to v1")):
        AuditEntry.objects.create(
            actor=actor, action="cost_model.activate", object_type="capacity.costmodel",
            object_id=str(audited.pk), reason=reason,
        )  # fmt: skip
    unaudited = version(2, "active", when)
    never = version(3, "candidate", None)

    new = migrate_to([("capacity", "0025_cost_model_review")])

    rows = new.get_model("capacity", "CostModel").objects
    assert (rows.get(pk=audited.pk).approved_by, rows.get(pk=audited.pk).approval_reason) == (
        "user:alice",
        "back to v1",
    )
    assert rows.get(pk=unaudited.pk).approved_by == "unknown"
    assert "before approvals were recorded" in rows.get(pk=unaudited.pk).approval_reason
    assert rows.get(pk=never.pk).approved_by == ""


def test_deployments_take_the_hour_their_nightly_row_ran_at(back_to_the_leaf):
    old = migrate_to([("capacity", "0025_cost_model_review")])
    Deployment = old.get_model("capacity", "Deployment")
    pool = GpuPoolFactory()
    served_model = old_served_model(old, pool.gpu_type_id)

    def deployment(name):
        return Deployment.objects.create(
            name=name, served_model_id=served_model.pk, gpu_pool_id=pool.pk,
            benchmark_nightly=True,
        )  # fmt: skip

    edited, odd, unscheduled = deployment("edited"), deployment("odd"), deployment("none")
    for row_of, hour in ((edited, "5"), (odd, "*/6")):
        crontab = CrontabSchedule.objects.create(minute="0", hour=hour, timezone="UTC")
        PeriodicTask.objects.create(
            name=f"nightly benchmark: {row_of.name}", task="benchmarking.benchmark_deployment",
            crontab=crontab, args=json.dumps([row_of.pk]),
        )  # fmt: skip

    new = migrate_to([("capacity", "0026_deployment_benchmark_hour_utc")])

    rows = new.get_model("capacity", "Deployment").objects
    assert rows.get(pk=edited.pk).benchmark_hour_utc == 5
    assert rows.get(pk=odd.pk).benchmark_hour_utc == 2  # not a plain hour: the default
    assert rows.get(pk=unscheduled.pk).benchmark_hour_utc == 2

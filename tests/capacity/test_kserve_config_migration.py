"""A Kubernetes config stored as kind Custom for KServe's InferenceService (which has no scale
subresource, so every push answered 404 on a real cluster) becomes kind InferenceService,
with an audit entry; other configs are left as they were."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("capacity", "0021_kubernetes_reconcile")]
AFTER = [("capacity", "0022_kserve_configs_use_their_own_kind")]

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_databases]

KSERVE_CUSTOM = {
    "namespace": "inference",
    "name": "llama",
    "kind": "Custom",
    "group": "serving.kserve.io",
    "version": "v1beta1",
    "plural": "inferenceservices",
    "cluster": "in-cluster",
}
LWS_CUSTOM = KSERVE_CUSTOM | {
    "group": "leaderworkerset.x-k8s.io",
    "version": "v1",
    "plural": "leaderworkersets",
}


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def test_stored_kserve_configs_take_their_own_kind_and_the_change_is_audited():
    from tests.support.factories import GpuPoolFactory
    from tests.support.migrations import old_served_model

    old = _migrate(BEFORE)
    try:
        # Rows as the schema stood at 0021: today's model has columns later migrations add.
        OldDeployment = old.get_model("capacity", "Deployment")
        pool = GpuPoolFactory()
        served_model = old_served_model(old, pool.gpu_type_id)

        def stored(name, config):
            return OldDeployment.objects.create(
                name=name,
                served_model_id=served_model.pk,
                gpu_pool_id=pool.pk,
                actuator_kind="kubernetes",
                actuator_config=config,
            )

        kserve = stored("kserve", KSERVE_CUSTOM)
        lws = stored("lws", LWS_CUSTOM)
        assert OldDeployment.objects.count() == 2

        new = _migrate(AFTER)

        Deployment = new.get_model("capacity", "Deployment")
        assert Deployment.objects.get(pk=kserve.pk).actuator_config == {
            "namespace": "inference",
            "name": "llama",
            "kind": "InferenceService",
            "cluster": "in-cluster",
        }
        assert Deployment.objects.get(pk=lws.pk).actuator_config == LWS_CUSTOM
        [entry] = new.get_model("controlplane", "AuditEntry").objects.filter(
            action="deployment.actuator_config_migrated"
        )
        assert entry.object_id == str(kserve.pk)
        assert entry.before == {"actuator_config": KSERVE_CUSTOM}
        assert entry.actor.startswith("system:migration capacity.0022")
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())

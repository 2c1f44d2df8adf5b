"""KServe's InferenceService has no scale subresource (its CRD declares `status` only), so a
stored Kubernetes config of kind Custom naming serving.kserve.io/inferenceservices answered
404 on every push on a real cluster (issue 20). Such configs become kind InferenceService,
which sets spec.predictor.minReplicas/maxReplicas; each change is in the audit log."""

from django.db import migrations
from django.utils import timezone

ACTOR = "system:migration capacity.0022_kserve_configs_use_their_own_kind"
_MOVED = ("group", "version", "plural")


def forwards(apps, schema_editor):
    Deployment = apps.get_model("capacity", "Deployment")
    AuditEntry = apps.get_model("controlplane", "AuditEntry")
    now = timezone.now()
    for deployment in Deployment.objects.filter(actuator_kind="kubernetes").order_by("pk"):
        config = deployment.actuator_config
        if not (
            isinstance(config, dict)
            and config.get("kind") == "Custom"
            and config.get("group") == "serving.kserve.io"
            and config.get("plural") == "inferenceservices"
        ):
            continue
        before = dict(config)
        after = {key: value for key, value in config.items() if key not in _MOVED}
        after["kind"] = "InferenceService"
        deployment.actuator_config = after
        deployment.save(update_fields=["actuator_config"])
        AuditEntry.objects.create(
            at=now,
            actor=ACTOR,
            action="deployment.actuator_config_migrated",
            object_type="capacity.deployment",
            object_id=str(deployment.pk),
            object_repr=deployment.name,
            before={"actuator_config": before},
            after={"actuator_config": after},
            reason=(
                "KServe's InferenceService has no scale subresource: kind InferenceService "
                "sets spec.predictor.minReplicas/maxReplicas instead"
            ),
        )


class Migration(migrations.Migration):
    dependencies = [
        ("capacity", "0021_kubernetes_reconcile"),
        ("controlplane", "0001_initial"),
    ]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]

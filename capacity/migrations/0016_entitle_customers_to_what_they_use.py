"""Entitlements start as what each customer already uses, so that nothing breaks when gateways
begin to enforce them: every customer is entitled to each model it has a reservation for
(any status) or usage of (events or minute rollups)."""

from django.db import migrations


def entitle_existing(apps, schema_editor):
    Entitlement = apps.get_model("capacity", "Entitlement")
    pairs = set()
    for model_name in ("Reservation", "UsageEvent", "UsageMinute"):
        rows = apps.get_model("capacity", model_name).objects.values_list(
            "customer_id", "served_model_id"
        )
        pairs.update(rows.distinct())
    Entitlement.objects.bulk_create(
        [
            Entitlement(customer_id=customer_id, served_model_id=model_id, granted_by="migration")
            for customer_id, model_id in sorted(pairs)
        ],
        ignore_conflicts=True,
    )


class Migration(migrations.Migration):
    dependencies = [
        ("capacity", "0015_entitlements"),
    ]

    operations = [
        # Backwards: the table goes with 0015; nothing to undo here.
        migrations.RunPython(entitle_existing, migrations.RunPython.noop),
    ]

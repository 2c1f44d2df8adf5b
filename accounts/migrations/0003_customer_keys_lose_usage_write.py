"""Customer keys may hold usage:write only when a planner lets the customer report its own
usage (issue 15). Keys that held it before the rule lose the scope; each change is written to
the audit log with the key's scopes before and after, so a planner can see whom it affected
(and, by setting the customer's may_report_own_usage, let it mint such a key again)."""

from django.db import migrations
from django.utils import timezone

ACTOR = "system:migration accounts.0003_customer_keys_lose_usage_write"


def forwards(apps, schema_editor):
    ApiKey = apps.get_model("accounts", "ApiKey")
    AuditEntry = apps.get_model("controlplane", "AuditEntry")
    now = timezone.now()
    changed = 0
    for key in ApiKey.objects.filter(customer__isnull=False).select_related("customer"):
        if "usage:write" not in key.scopes or key.customer.may_report_own_usage:
            continue
        before = list(key.scopes)
        key.scopes = [scope for scope in key.scopes if scope != "usage:write"]
        reason = (
            f"customer {key.customer.slug} may not report its own usage; the key keeps "
            f"{', '.join(key.scopes) or 'no scopes'}"
        )
        if not key.scopes:
            # A key whose only scope was usage:write would be left holding nothing: revoke it.
            key.revoked_at = key.revoked_at or now
            reason += " and is revoked, as usage:write was its only scope"
        key.save(update_fields=["scopes", "revoked_at"])
        AuditEntry.objects.create(
            at=now,
            actor=ACTOR,
            action="api_key.scope_removed",
            object_type="accounts.apikey",
            object_id=str(key.pk),
            object_repr=f"{key.prefix} (customer:{key.customer.slug})",
            before={"scopes": before},
            after={"scopes": key.scopes, "revoked": key.revoked_at is not None},
            reason=reason,
        )
        changed += 1
    if changed:
        print(f"\n  usage:write removed from {changed} customer key(s); see the audit log.")


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0002_self_reported_usage_and_keys_made_by_keys"),
        ("controlplane", "0001_initial"),
    ]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]

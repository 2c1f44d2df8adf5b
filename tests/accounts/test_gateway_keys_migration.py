"""Migration accounts 0005 (issue 34, finding 2): gateways send requests only with keys holding
`admission`, so the service keys gateways use today (those posting usage, and the demo's
gateway key) gain it; every other service key is left without it, and `list_gateway_keys`
names those (they lose gateway access). Reversing takes `admission` back from exactly the keys
the migration gave it to."""

import pytest
from django.core.management import call_command

from tests.support.migrations import migrate_to, migrate_to_the_leaf

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_databases]

BEFORE = ("accounts", "0004_tiers")
ADMISSION = ("accounts", "0005_service_gateway_keys_get_admission")
ACTOR = "system:migration accounts.0005_service_gateway_keys_get_admission"


def test_gateway_service_keys_gain_admission_and_the_others_are_listed_as_refused(
    back_to_the_leaf, capsys
):
    old = migrate_to([BEFORE])
    ApiKey = old.get_model("accounts", "ApiKey")
    Customer = old.get_model("accounts", "Customer")
    acme = Customer.objects.create(name="Acme", slug="acme", may_report_own_usage=True)

    def key(prefix, scopes, *, service="", customer=None, revoked=False):
        return ApiKey.objects.create(
            name=prefix,
            prefix=prefix,
            secret_sha256="0" * 64,
            service_name=service,
            customer=customer,
            scopes=scopes,
            revoked_at="2026-01-01T00:00:00Z" if revoked else None,
        )

    before = {
        # A gateway's key as README told operators to make it, and one that only posts usage.
        "mugateway0001": key("mugateway0001", ["read", "usage:write"], service="gateway"),
        "mugateway0002": key("mugateway0002", ["usage:write"], service="edge-gateway"),
        # The demo's gateway key, whatever scopes an old seed gave it.
        "mudemogatew01": key("mudemogatew01", ["read"], service="demo-gateway"),
        # Had it already: unchanged, and not counted as the migration's.
        "mugateway0003": key("mugateway0003", ["usage:write", "admission"], service="gateway"),
        # A dashboard's read-only key: the finding's key. It loses gateway access.
        "mudashboard01": key("mudashboard01", ["read"], service="dashboard"),
        "muprovision01": key("muprovision01", ["read", "customers:write"], service="crm"),
        # Revoked: left alone. A customer's key: not a service key.
        "murevoked0001": key("murevoked0001", ["usage:write"], service="gateway", revoked=True),
        "mucustomer001": key("mucustomer001", ["read", "usage:write"], customer=acme),
    }
    scopes_before = {prefix: list(api_key.scopes) for prefix, api_key in before.items()}

    new = migrate_to([ADMISSION])

    scopes = dict(new.get_model("accounts", "ApiKey").objects.values_list("prefix", "scopes"))
    gained = {"mugateway0001", "mugateway0002", "mudemogatew01"}
    assert {prefix for prefix in before if scopes[prefix] != scopes_before[prefix]} == gained
    assert scopes["mugateway0001"] == ["read", "usage:write", "admission"]
    assert scopes["mugateway0002"] == ["usage:write", "admission"]
    assert scopes["mudemogatew01"] == ["read", "admission"]
    printed = capsys.readouterr().out
    assert "admission added to 3 gateway service key(s)" in printed
    entries = new.get_model("controlplane", "AuditEntry").objects.filter(actor=ACTOR)
    assert {(entry.action, entry.object_repr) for entry in entries} == {
        ("api_key.scope_added", "mugateway0001 (service:gateway)"),
        ("api_key.scope_added", "mugateway0002 (service:edge-gateway)"),
        ("api_key.scope_added", "mudemogatew01 (service:demo-gateway)"),
    }
    demo = entries.get(object_repr__startswith="mudemogatew01")
    assert (demo.before, demo.after) == ({"scopes": ["read"]}, {"scopes": ["read", "admission"]})

    # Today's command on the migrated rows: the keys that lose gateway access, by name.
    migrate_to_the_leaf()
    call_command("list_gateway_keys")
    listing = capsys.readouterr().out
    accepted, refused = listing.split("Service keys a gateway refuses")
    assert "Service keys a gateway accepts (admission): 4" in accepted
    for prefix in ("mugateway0001", "mugateway0002", "mudemogatew01", "mugateway0003"):
        assert prefix in accepted and prefix not in refused
    assert "(no admission): 2" in refused
    assert "mudashboard01  service:dashboard" in refused and "muprovision01" in refused
    for prefix in ("murevoked0001", "mucustomer001"):
        assert prefix not in listing

    # Reversed: admission goes from the keys the migration gave it to, and only from those.
    reverted = migrate_to([BEFORE])
    scopes = dict(reverted.get_model("accounts", "ApiKey").objects.values_list("prefix", "scopes"))
    assert scopes == scopes_before
    removals = reverted.get_model("controlplane", "AuditEntry").objects.filter(
        actor=ACTOR, action="api_key.scope_removed"
    )
    assert removals.count() == 3

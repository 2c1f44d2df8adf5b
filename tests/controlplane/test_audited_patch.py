"""The three resources changed by PATCH only, through their app's audited service
(core.api.mixins.AuditedPatchMixin): tiers, request limits and budgets alike answer the changed
object, record who changed what, refuse a field that cannot change by name, and offer no PUT."""

import pytest

from core.models import AuditEntry

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

# resource URL, what creates one (None: a default tier), a change, the audit action
RESOURCES = [
    ("/api/v1/tiers/", None, {"weight": 2.5}, "tier.update"),
    (
        "/api/v1/request-limits/",
        {"customer": "acme", "requests_per_minute": 60},
        {"requests_per_minute": 90},
        "request_limit.update",
    ),
    (
        "/api/v1/budgets/",
        {"customer": "acme", "monthly_amount": "100.00"},
        {"monthly_amount": "250.00"},
        "budget.update",
    ),
]


@pytest.mark.parametrize(("url", "body", "change", "action"), RESOURCES)
def test_a_change_by_patch_is_answered_audited_and_held_to_the_fields_that_may_change(
    planner_client, acme, url, body, change, action
):
    if body is None:
        resource = f"{url}standard/"
    else:
        created = planner_client.post(url, body, format="json")
        assert created.status_code == 201, created.json()
        resource = f"{url}{created.json()['id']}/"

    changed = planner_client.patch(resource, change, format="json")

    assert changed.status_code == 200, changed.json()
    ((name, value),) = change.items()
    assert changed.json()[name] == value
    assert planner_client.get(resource).json()[name] == value
    entry = AuditEntry.objects.get(action=action)
    assert entry.actor == "user:planner"
    assert str(entry.after[name]) == str(value)

    refused = planner_client.patch(resource, {"colour": "red"}, format="json")
    assert refused.status_code == 400
    assert "colour" in refused.json()["error"]["fields"]
    assert planner_client.put(resource, change, format="json").status_code == 405
    assert AuditEntry.objects.filter(action=action).count() == 1

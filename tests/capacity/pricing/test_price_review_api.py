"""The planner's review of a price change through the API (issue 21): the change per customer
and per shape (planners and platform services only), activate and reject with a reason, who
approved it kept on the version and in the audit log, and the usage priced after an activation
priced by the new version through the real ingestion path."""

import pytest

from capacity.models import UsageEvent
from capacity.repricing.services import cost_model_activate, cost_model_reject
from core.models import AuditEntry
from tests.capacity.pricing.conftest import COST_MODELS
from tests.conftest import SIMPLE_WEIGHTS, make_cost_model
from tests.support.usage import post_usage, replica_seconds, scaled

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def test_a_planner_sees_the_per_customer_difference_approves_it_and_later_usage_uses_it(
    last_week, served_model, gpu_type, gateway, planner_client
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3, output_tokens=1.5))
    assert v2.status == "candidate"

    response = planner_client.get(f"{COST_MODELS}{v2.pk}/price-change/")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["basis"] == "traffic" and body["compared_with_version"] == 1
    assert body["prices_usage"] is True
    acme = next(row for row in body["by_customer"] if row["key"] == "acme")
    acme_before = replica_seconds(SIMPLE_WEIGHTS, 1000, 100)
    acme_after = replica_seconds(scaled(1.3, output_tokens=1.5), 1000, 100)
    assert acme["change"] == pytest.approx(acme_after / acme_before - 1)
    assert acme["requests"] == 10
    assert len(body["by_shape"]) == 2

    response = planner_client.post(
        f"{COST_MODELS}{v2.pk}/activate/",
        {"reason": "the new engine build is slower on long answers"},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "active"
    assert response.json()["approved_by"] == "user:planner"
    v2.refresh_from_db()
    last_week.refresh_from_db()
    assert (v2.status, last_week.status) == ("active", "retired")
    assert v2.approval_reason == "the new engine build is slower on long answers"
    entry = AuditEntry.objects.get(action="cost_model.activate", object_id=str(v2.pk))
    assert entry.actor == "user:planner"
    assert entry.reason == "the new engine build is slower on long answers"
    assert entry.after["price_change"] == pytest.approx(body["change"])
    assert "on the last 7 days of traffic" in entry.after["price_change_on"]

    # Usage that runs from now on is priced with v2; what was priced before keeps v1.
    (after,) = post_usage(gateway, "acme", count=1, input_tokens=1000, output_tokens=100)
    stored = UsageEvent.objects.get(event_id=after)
    assert stored.cost_model_id == v2.pk
    assert stored.mu == pytest.approx(acme_after * 100 / 60)
    assert set(
        UsageEvent.objects.exclude(event_id=after).values_list("cost_model_id", flat=True)
    ) == {last_week.pk}


def test_a_planner_rejects_a_candidate_and_it_stays_out_of_force(
    last_week, served_model, gpu_type, planner_client, acme_key_client
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))

    assert acme_key_client.post(f"{COST_MODELS}{v2.pk}/reject/").status_code == 403
    response = planner_client.post(
        f"{COST_MODELS}{v2.pk}/reject/", {"reason": "noisy run"}, format="json"
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["status"], body["rejected_by"], body["rejection_reason"]) == (
        "rejected",
        "user:planner",
        "noisy run",
    )
    last_week.refresh_from_db()
    assert last_week.status == "active"
    entry = AuditEntry.objects.get(action="cost_model.reject", object_id=str(v2.pk))
    assert (entry.actor, entry.reason) == ("user:planner", "noisy run")
    assert entry.after["price_change"] == pytest.approx(0.30)

    # Only a candidate is rejected; an active version is retired instead.
    response = planner_client.post(f"{COST_MODELS}{last_week.pk}/reject/")
    assert response.status_code == 409
    assert "retire an active version instead" in response.json()["error"]["message"]
    # A planner may still change their mind.
    v2.refresh_from_db()
    assert cost_model_activate(cost_model=v2, actor="user:planner").status == "active"


def test_customers_see_prices_but_not_the_review(
    last_week, served_model, gpu_type, acme_key_client
):
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))
    row = acme_key_client.get(f"{COST_MODELS}{v2.pk}/").json()
    assert row["status"] == "candidate"
    assert not {"price_change", "review_reason", "approved_by", "rejected_by"} & set(row)
    assert acme_key_client.get(f"{COST_MODELS}{v2.pk}/price-change/").status_code == 403


def test_the_price_change_of_the_active_version_is_a_409(last_week, planner_client):
    response = planner_client.get(f"{COST_MODELS}{last_week.pk}/price-change/")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "nothing_to_compare"


def test_rejecting_needs_a_candidate_and_the_service_says_so(last_week):
    from core.errors import ConflictError

    with pytest.raises(ConflictError, match="Version 1 is active; only a candidate is rejected"):
        cost_model_reject(cost_model=last_week, actor="user:planner")


def test_the_admin_decides_through_the_same_services_and_shows_the_review(
    client, django_user_model, last_week, served_model, gpu_type
):
    from django.urls import reverse

    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    v2 = make_cost_model(served_model, gpu_type, weights=scaled(1.3))
    v3 = make_cost_model(served_model, gpu_type, weights=scaled(1.5))
    changelist = reverse("admin:capacity_costmodel_changelist")
    assert "+30.0 %" in client.get(changelist).content.decode()
    page = client.get(reverse("admin:capacity_costmodel_change", args=[v2.pk])).content.decode()
    assert "Waits for a planner: v1 → v2 moves prices by +30.0 %" in page

    response = client.post(
        changelist,
        {"action": "reject_selected", "_selected_action": [v2.pk, last_week.pk]},
        follow=True,
    )
    assert "1 version(s) rejected." in response.content.decode()
    assert "only a candidate is rejected" in response.content.decode()  # v1 is active
    v2.refresh_from_db()
    assert (v2.status, v2.rejected_by) == ("rejected", "user:root")

    client.post(changelist, {"action": "activate_selected", "_selected_action": [v3.pk]})
    v3.refresh_from_db()
    assert (v3.status, v3.approved_by) == ("active", "user:root")
    entry = AuditEntry.objects.get(action="cost_model.activate", object_id=str(v3.pk))
    assert entry.actor == "user:root" and entry.after["price_change"] == pytest.approx(0.5)

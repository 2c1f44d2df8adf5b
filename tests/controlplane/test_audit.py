"""Every change names who made it, and what it was before and after (issue 16): the writes the
issue lists, through the API, the planner UI and the admin; and the admin can no longer rewrite
billed history."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.generation import invoice_generate
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.models import CostModel, DeploymentFingerprint, Reservation, ReservationChange
from core.models import AuditEntry
from tests.conftest import make_cost_model

pytestmark = pytest.mark.django_db


def entry(action: str) -> AuditEntry:
    return AuditEntry.objects.filter(action=action).latest("at", "id")


@pytest.fixture
def provisioner(make_key, key_client):
    api_key, plaintext = make_key(
        service_name="provisioner", scopes=["read", "catalog:write", "customers:write"]
    )
    return api_key, key_client(plaintext)


def test_catalog_and_actuator_changes_name_the_key_and_the_fields(provisioner, deployment):
    api_key, client = provisioner
    answer = client.patch(
        f"/api/v1/deployments/{deployment.name}/",
        {"max_replicas": 3, "target_utilisation": 0.7},
        format="json",
    )
    assert answer.status_code == 200, answer.json()
    change = entry("deployment.update")
    assert change.actor == f"key:{api_key.prefix} (service:provisioner)"
    assert change.before == {"max_replicas": 4, "target_utilisation": deployment.target_utilisation}
    assert change.after == {"max_replicas": 3, "target_utilisation": 0.7}
    assert change.object_repr == str(deployment)

    created = client.post(
        "/api/v1/gpu-types/", {"name": "L4-24GB", "memory_gb": 24, "hourly_cost_usd": "0.80"},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201
    assert entry("gpu_type.create").after["name"] == "L4-24GB"
    assert client.delete("/api/v1/gpu-types/L4-24GB/").status_code == 204
    deleted = entry("gpu_type.delete")
    assert (deleted.before["name"], deleted.after) == ("L4-24GB", None)


def test_customer_changes_and_key_revocations_are_recorded(planner_client, acme, make_key):
    answer = planner_client.patch("/api/v1/customers/acme/", {"tier": "premium"}, format="json")
    assert answer.status_code == 200
    change = entry("customer.update")
    assert (change.actor, change.before, change.after) == (
        "user:planner",
        {"tier": "standard"},
        {"tier": "premium"},
    )
    api_key, _ = make_key(customer=acme)
    planner_client.post(f"/api/v1/api-keys/{api_key.pk}/revoke/")
    revoked = entry("api_key.revoke")
    assert (revoked.actor, revoked.before) == ("user:planner", {"revoked_at": None})
    assert revoked.after["revoked_at"] is not None


def test_rate_cards_and_invoice_issue_are_recorded(planner_client, served_model, acme):
    body = {
        "model": served_model.name,
        "effective_from": "2026-10-01T00:00:00Z",
        "reserved_price_per_mu_minute_hour": "0.10",
        "best_effort_price_per_1000_mu": "2.00",
    }
    card = planner_client.post("/api/v1/rate-cards/", body, format="json").json()
    assert Decimal(entry("rate_card.create").after["best_effort_price_per_1000_mu"]) == 2
    planner_client.patch(
        f"/api/v1/rate-cards/{card['id']}/", {"best_effort_price_per_1000_mu": "2.50"},
        format="json",
    )  # fmt: skip
    change = entry("rate_card.update")
    assert list(change.before) == list(change.after) == ["best_effort_price_per_1000_mu"]
    assert Decimal(change.before["best_effort_price_per_1000_mu"]) == Decimal("2.00")
    assert Decimal(change.after["best_effort_price_per_1000_mu"]) == Decimal("2.50")
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=10,
        starts_at=datetime(2026, 11, 1, tzinfo=UTC),
        status="active",
    )
    invoice_generate(period="2026-11")
    invoice = Invoice.objects.get(customer=acme)
    planner_client.post(f"/api/v1/invoices/{invoice.pk}/issue/")
    issued = entry("invoice.issue")
    assert (issued.actor, issued.before, issued.after["status"]) == (
        "user:planner",
        {"status": "draft"},
        "issued",
    )


def test_cost_model_activation_says_who_approved_it_or_why_it_was_automatic(
    planner_client, served_model, gpu_type
):
    first = make_cost_model(served_model, gpu_type)
    automatic = entry("cost_model.activate")
    assert automatic.actor == "system:auto"
    assert "MAPE" in automatic.reason
    second = make_cost_model(served_model, gpu_type)  # supersedes the first
    planner_client.post(f"/api/v1/cost-models/{first.pk}/activate/")
    approved = entry("cost_model.activate")
    assert approved.actor == "user:planner"
    assert approved.before == {"status": "retired", "active_versions": [second.version]}
    planner_client.post(f"/api/v1/cost-models/{first.pk}/retire/")
    assert entry("cost_model.retire").after == {"status": CostModel.Status.RETIRED}


def test_degradation_policies_and_fingerprint_resets_are_recorded(
    planner_client, served_model, deployment
):
    url = f"/api/v1/degradation/{served_model.name}/policy"
    planner_client.put(url, {"degrade_below": 0.5, "recover_at": 0.8}, format="json")
    created = entry("degradation_policy.create")
    assert created.after["degrade_below"] == 0.5
    planner_client.put(url, {"degrade_below": 0.6}, format="json")
    assert entry("degradation_policy.update").before == {"degrade_below": 0.5}

    DeploymentFingerprint.objects.create(
        deployment=deployment,
        prompt="p",
        answer="hello",
        answer_sha256="0" * 64,
        recorded_at=timezone.now(),
    )
    planner_client.post(f"/api/v1/health/deployments/{deployment.name}/reset-fingerprint")
    reset = entry("fingerprint.reset")
    assert reset.before["fingerprint"]["answer"] == "hello"
    assert reset.after == {"fingerprint": None}


def test_the_planner_sees_the_log_overall_and_per_object(planner_client, acme, make_key):
    planner_client.patch("/api/v1/customers/acme/", {"name": "Acme Corp"}, format="json")
    page = planner_client.get(reverse("planner:audit:list"))
    assert page.status_code == 200
    text = page.content.decode()
    assert "customer.update" in text and "Acme Corp" in text and "user:planner" in text
    detail = planner_client.get(reverse("planner:customers:detail", args=["acme"])).content.decode()
    assert "History" in detail and "customer.update" in detail
    filtered = planner_client.get(
        reverse("planner:audit:list"),
        {"object_type": "accounts.customer", "object_id": acme.pk},
    ).content.decode()
    assert "customer.update" in filtered


def test_admin_changes_are_recorded_with_the_staff_user(client, django_user_model, gpu_type):
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    url = reverse("admin:capacity_gputype_change", args=[gpu_type.pk])
    answer = client.post(
        url, {"name": gpu_type.name, "memory_gb": 80, "hourly_cost_usd": "9.99"}, follow=True
    )
    assert answer.status_code == 200
    change = entry("gputype.update")
    assert change.actor == "user:root"
    assert change.after == {"hourly_cost_usd": "9.99"}


def test_the_admin_cannot_rewrite_billed_history(
    client, django_user_model, served_model, acme, make_key
):
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(root)
    card = rate_card_create(
        served_model=served_model,
        effective_from=datetime(2026, 10, 1, tzinfo=UTC),
        reserved_price_per_mu_minute_hour=Decimal("0.10"),
        best_effort_price_per_1000_mu=Decimal("2.00"),
    )
    reservation = Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=10,
        starts_at=datetime(2026, 11, 1, tzinfo=UTC),
        status="active",
    )
    ReservationChange.objects.create(
        reservation=reservation, kind="created", changes={}, changed_by="seed"
    )
    invoice_generate(period="2026-11")
    invoice = Invoice.objects.get(customer=acme)
    draft_delete = reverse("admin:billing_invoice_delete", args=[invoice.pk])
    assert client.get(draft_delete).status_code == 200  # a draft may still go
    invoice.status = "issued"
    invoice.save()
    assert client.get(draft_delete).status_code == 403
    assert (
        client.post(reverse("admin:billing_ratecard_change", args=[card.pk]), {}).status_code == 403
    )
    change = ReservationChange.objects.get()
    assert (
        client.post(
            reverse("admin:capacity_reservationchange_change", args=[change.pk]), {}
        ).status_code
        == 403
    )
    assert (
        client.get(reverse("admin:capacity_reservation_delete", args=[reservation.pk])).status_code
        == 403
    )

    api_key, _ = make_key(customer=acme)
    api_key.revoked_at = timezone.now() - timedelta(hours=1)
    api_key.save()
    form = client.get(reverse("admin:accounts_apikey_change", args=[api_key.pk])).content.decode()
    assert 'name="revoked_at' not in form and 'name="scopes' not in form
    client.post(reverse("admin:accounts_apikey_change", args=[api_key.pk]), {"name": "renamed"})
    api_key.refresh_from_db()
    assert api_key.revoked_at is not None

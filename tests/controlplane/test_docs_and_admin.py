import pytest
from django.apps import apps
from django.contrib import admin
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_the_openapi_schema_and_the_docs_are_served(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    body = schema.json()
    assert body["openapi"].startswith("3.")
    assert "/api/v1/deployments/" in body["paths"]
    assert "BearerApiKey" in body["components"]["securitySchemes"]

    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()


def test_the_admin_login_page_is_served(client):
    response = client.get("/admin/login/")
    assert response.status_code == 200
    assert b"password" in response.content.lower()


def test_every_model_of_our_apps_has_an_admin_page_that_loads(
    client, django_user_model, deployment, make_key, acme, owner
):
    make_key(customer=acme)
    superuser = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(superuser)
    for app_label in (
        "controlplane",
        "accounts",
        "capacity",
        "benchmarking",
        "billing",
        "planner",
        "portal",
    ):
        for model in apps.get_app_config(app_label).get_models():
            assert model in admin.site._registry, f"{model.__name__} has no admin page"
            opts = model._meta
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
            assert client.get(url).status_code == 200, url
            assert client.get(url + "?q=a").status_code == 200, url
            instance = model.objects.first()
            if instance is not None:
                change = reverse(
                    f"admin:{opts.app_label}_{opts.model_name}_change", args=[instance.pk]
                )
                assert client.get(change).status_code == 200, change


def test_pagination_and_filtering_shape(planner_client, gpu_type):
    from tests.support.factories import GpuPoolFactory

    for index in range(7):
        GpuPoolFactory(name=f"pool-{index:02d}", gpu_type=gpu_type, gpu_count=index + 1)
    page = planner_client.get("/api/v1/gpu-pools/?page_size=3&ordering=-gpu_count").json()
    assert page["count"] == 7
    assert [row["name"] for row in page["results"]] == ["pool-06", "pool-05", "pool-04"]
    assert page["next"] is not None
    filtered = planner_client.get(f"/api/v1/gpu-pools/?gpu_type__name={gpu_type.name}").json()
    assert filtered["count"] == 7
    searched = planner_client.get("/api/v1/gpu-pools/?search=pool-03").json()
    assert [row["name"] for row in searched["results"]] == ["pool-03"]


def test_the_admin_refuses_a_deployment_larger_than_its_pool(
    client, django_user_model, served_model, pool
):
    from capacity.models import Deployment

    superuser = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(superuser)
    response = client.post(
        reverse("admin:capacity_deployment_add"),
        {
            "name": "too-big",
            "served_model": served_model.pk,
            "gpu_pool": pool.pk,
            "gpus_per_replica": 4,
            "min_replicas": 0,
            "max_replicas": 3,
            "current_replicas": 0,
            "cold_start_seconds": 60,
            "target_utilisation": 0.8,
            "actuator_kind": "dry_run",
            "actuator_config": "{}",
        },
    )
    assert response.status_code == 200  # the form again, with the error
    assert b"12 GPUs exceeds pool" in response.content
    assert not Deployment.objects.filter(name="too-big").exists()


def test_the_admin_checks_an_engine_profile_as_the_api_does(
    client, django_user_model, served_model, pool
):
    from capacity.models import Deployment

    superuser = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(superuser)
    form = {
        "name": "llama-8b-h100",
        "served_model": served_model.pk,
        "gpu_pool": pool.pk,
        "gpus_per_replica": 1,
        "min_replicas": 0,
        "max_replicas": 2,
        "current_replicas": 0,
        "cold_start_seconds": 60,
        "target_utilisation": 0.8,
        "actuator_kind": "dry_run",
        "actuator_config": "{}",
        "benchmark_hour_utc": 2,
    }
    refused = client.post(
        reverse("admin:capacity_deployment_add"), form | {"engine_profile": '{"max_seqs": 64}'}
    )
    assert refused.status_code == 200  # the form again, with the error
    assert "engine_profile.max_seqs: unknown engine parameter" in refused.content.decode()
    assert not Deployment.objects.exists()
    saved = client.post(
        reverse("admin:capacity_deployment_add"), form | {"engine_profile": '{"max_num_seqs": 64}'}
    )
    assert saved.status_code == 302
    assert Deployment.objects.get().engine_profile == {"max_num_seqs": 64}


def _references(html: str) -> list[str]:
    import re

    return re.findall(r'(?:src|href)="([^"]*)"', html)


def test_the_api_docs_load_swagger_ui_only_from_this_servers_static_files(client):
    import re

    docs = client.get("/api/docs/")
    html = docs.content.decode()
    references = _references(html)
    assert any(ref.endswith("swagger-ui-bundle.js") for ref in references)
    for ref in references:
        assert ref.startswith(("/static/", "/api/")), ref
    assert "cdn" not in html.lower()
    # No inline script: the page's own init script is a URL of the docs view.
    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", html) == []
    script_url = next(ref for ref in references if ref.startswith("/api/docs/"))
    script = client.get(script_url.replace("&amp;", "&"))
    assert script.status_code == 200
    assert script["Content-Type"].startswith("application/javascript")
    assert b"SwaggerUIBundle" in script.content


@pytest.mark.parametrize("path", ["/api/docs/", "/login/", "/admin/login/", "/api/v1/me"])
def test_responses_carry_a_content_security_policy_with_scripts_only_from_self(client, path):
    policy = client.get(path)["Content-Security-Policy"]
    directives = dict(
        (part.strip().split(" ", 1) + [""])[:2] for part in policy.split(";") if part.strip()
    )
    assert directives["script-src"] == "'self'"
    assert directives["default-src"] == "'self'"
    assert directives["object-src"] == "'none'"


def test_planner_and_admin_pages_have_no_inline_scripts(planner_client, planner):
    import re

    planner.is_superuser = True
    planner.save()
    for path in ("/planner/", "/planner/customers/", "/admin/", "/admin/capacity/deployment/"):
        response = planner_client.get(path)
        assert response.status_code == 200, path
        html = response.content.decode()
        inline = re.findall(r"<script(?![^>]*\bsrc=)(?![^>]*application/json)[^>]*>", html)
        assert inline == [], path
        assert re.findall(r"\son[a-z]+=", html) == [], path


# Rows only ingestion and the allocation tick write (issue 34, finding 14): a superuser could
# add usage in the admin, with no audit entry and beyond the model's context.
SYSTEM_WRITTEN = [
    "usageevent",
    "usageminute",
    "usagekeyminute",
    "fallbackadmission",
    "capacitysample",
    "allocationdecision",
    "admissionallowance",
]


@pytest.fixture
def superuser_client(client, django_user_model):
    superuser = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(superuser)
    return client


@pytest.mark.parametrize("model_name", SYSTEM_WRITTEN)
def test_the_admin_offers_no_add_for_rows_only_the_system_writes(superuser_client, model_name):
    changelist = superuser_client.get(reverse(f"admin:capacity_{model_name}_changelist"))
    assert changelist.status_code == 200
    add_url = reverse(f"admin:capacity_{model_name}_add")
    assert add_url.encode() not in changelist.content
    assert superuser_client.get(add_url).status_code == 403


def test_a_superuser_cannot_add_a_usage_minute_beyond_anything_metered(
    superuser_client, acme, served_model
):
    from capacity.models import UsageMinute
    from core.models import AuditEntry

    response = superuser_client.post(
        reverse("admin:capacity_usageminute_add"),
        {
            "customer": acme.pk,
            "served_model": served_model.pk,
            "minute_0": "2026-11-01",
            "minute_1": "00:00:00",
            "requests": 1,
            "input_tokens": 10**12,  # far beyond any model's context
            "output_tokens": 0,
            "mu": 1e9,
        },
    )
    assert response.status_code == 403
    assert not UsageMinute.objects.exists()
    assert not AuditEntry.objects.exists()


def test_a_superuser_cannot_change_or_delete_usage_rollups(superuser_client, acme, served_model):
    from datetime import UTC, datetime

    from capacity.models import UsageKeyMinute, UsageMinute

    minute = datetime(2026, 11, 1, tzinfo=UTC)
    rolled = {"customer": acme, "served_model": served_model, "minute": minute, "mu": 5.0}
    key_minute = UsageKeyMinute.objects.create(api_key_prefix="muc0123456789", **rolled)
    usage_minute = UsageMinute.objects.create(**rolled)
    for row, name in ((key_minute, "usagekeyminute"), (usage_minute, "usageminute")):
        delete = reverse(f"admin:capacity_{name}_delete", args=[row.pk])
        assert superuser_client.post(delete, {"post": "yes"}).status_code == 403
        bulk = superuser_client.post(
            reverse(f"admin:capacity_{name}_changelist"),
            {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"},
        )
        assert bulk.status_code in (200, 302)  # the action is not offered: nothing happens
        change = reverse(f"admin:capacity_{name}_change", args=[row.pk])
        assert superuser_client.post(change, {"mu": 0}).status_code == 403
        row.refresh_from_db()
        assert row.mu == 5.0

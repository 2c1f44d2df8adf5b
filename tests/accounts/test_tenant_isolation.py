"""One customer never sees another's data; planners see everything."""

import pytest

from accounts.models import ApiKey

pytestmark = pytest.mark.django_db


@pytest.fixture
def keys(make_key, acme, globex):
    acme_key, _ = make_key(customer=acme, name="acme prod")
    globex_key, _ = make_key(customer=globex, name="globex prod")
    return {"acme": acme_key, "globex": globex_key}


def test_a_customer_key_gets_404_for_another_customers_key(acme_key_client, keys):
    assert acme_key_client.get(f"/api/v1/api-keys/{keys['acme'].pk}/").status_code == 200
    response = acme_key_client.get(f"/api/v1/api-keys/{keys['globex'].pk}/")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_a_customer_key_cannot_revoke_another_customers_key(acme_key_client, keys):
    response = acme_key_client.post(f"/api/v1/api-keys/{keys['globex'].pk}/revoke/")
    assert response.status_code == 404
    keys["globex"].refresh_from_db()
    assert keys["globex"].revoked_at is None


def test_a_customer_key_lists_only_its_own_keys(acme_key_client, keys):
    listed = acme_key_client.get("/api/v1/api-keys/").json()["results"]
    assert {row["customer"] for row in listed} == {"acme"}
    assert keys["globex"].prefix not in str(listed)


def test_a_customer_key_sees_only_its_customer(acme_key_client, globex):
    listed = acme_key_client.get("/api/v1/customers/").json()
    assert [row["slug"] for row in listed["results"]] == ["acme"]
    assert acme_key_client.get("/api/v1/customers/globex/").status_code == 404


def test_a_customer_key_cannot_create_a_key_for_another_customer(acme_key_client, globex):
    response = acme_key_client.post(
        "/api/v1/api-keys/", {"name": "sneaky", "customer": "globex"}, format="json"
    )
    assert response.status_code == 400  # as for a slug that does not exist
    assert not ApiKey.objects.filter(customer=globex).exists()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/gpu-types/", {"name": "X", "memory_gb": 80, "hourly_cost_usd": "1.0"}),
        ("/api/v1/gpu-pools/", {"name": "p", "gpu_type": "H100-80GB", "gpu_count": 4}),
        ("/api/v1/customers/", {"name": "New", "slug": "new"}),
    ],
)
def test_a_customer_key_gets_403_on_catalog_writes(acme_key_client, gpu_type, path, body):
    response = acme_key_client.post(path, body, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


def test_a_customer_key_gets_403_on_deployment_changes(acme_key_client, deployment):
    response = acme_key_client.patch(
        f"/api/v1/deployments/{deployment.name}/", {"max_replicas": 8}, format="json"
    )
    assert response.status_code == 403
    assert acme_key_client.delete(f"/api/v1/deployments/{deployment.name}/").status_code == 403
    deployment.refresh_from_db()
    assert deployment.max_replicas == 4


def test_customers_can_read_the_catalog(acme_key_client, deployment):
    response = acme_key_client.get("/api/v1/deployments/")
    assert response.status_code == 200
    assert response.json()["results"][0]["name"] == deployment.name


def test_owner_member_and_outsider_see_what_their_memberships_allow(
    owner_client, member_client, outsider_client, keys
):
    for client in (owner_client, member_client):
        listed = client.get("/api/v1/api-keys/").json()["results"]
        assert [row["name"] for row in listed] == ["acme prod"]
        assert client.get("/api/v1/customers/acme/").status_code == 200
        assert client.get("/api/v1/customers/globex/").status_code == 404

    listed = outsider_client.get("/api/v1/api-keys/").json()["results"]
    assert [row["name"] for row in listed] == ["globex prod"]
    assert outsider_client.get(f"/api/v1/api-keys/{keys['acme'].pk}/").status_code == 404
    assert outsider_client.get("/api/v1/customers/acme/").status_code == 404


def test_an_owner_revokes_their_customers_key_but_a_member_or_an_outsider_cannot(
    owner_client, member_client, outsider_client, keys
):
    acme_key = keys["acme"]
    assert outsider_client.post(f"/api/v1/api-keys/{acme_key.pk}/revoke/").status_code == 404
    # A member reads the key but may not revoke it: the portal's rule (issue 34).
    assert member_client.post(f"/api/v1/api-keys/{acme_key.pk}/revoke/").status_code == 403
    acme_key.refresh_from_db()
    assert acme_key.revoked_at is None

    assert owner_client.post(f"/api/v1/api-keys/{acme_key.pk}/revoke/").status_code == 200
    acme_key.refresh_from_db()
    assert acme_key.revoked_at is not None


def test_planners_see_everything(planner_client, keys):
    customers = planner_client.get("/api/v1/customers/").json()
    assert {row["slug"] for row in customers["results"]} == {"acme", "globex"}
    listed = planner_client.get("/api/v1/api-keys/").json()["results"]
    assert {row["name"] for row in listed} == {"acme prod", "globex prod"}
    assert planner_client.get(f"/api/v1/api-keys/{keys['globex'].pk}/").status_code == 200


def test_a_staff_user_outside_the_planners_group_is_no_planner(db):
    from rest_framework.test import APIClient

    from tests.support.factories import UserFactory

    staff = UserFactory(is_staff=True)
    client = APIClient()
    client.force_login(staff)
    assert client.get("/api/v1/me").json()["is_planner"] is False
    assert client.get("/api/v1/customers/").json()["count"] == 0


def test_me_tells_a_member_their_memberships(member_client):
    body = member_client.get("/api/v1/me").json()
    assert body["kind"] == "user"
    assert body["customers"] == [{"customer": "acme", "role": "member"}]
    assert body["is_planner"] is False


def test_anonymous_callers_get_401(anon, acme):
    for path in ("/api/v1/me", "/api/v1/customers/", "/api/v1/api-keys/", "/api/v1/models/"):
        response = anon.get(path)
        assert response.status_code in (401, 403), path
        assert response.json()["error"]["status"] == response.status_code

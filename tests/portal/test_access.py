"""Who reaches which portal page: every URL of the portal, whatever page added it, generated
from the URL conf. A customer's members reach its pages and no one else's (404, as for a
customer that does not exist); anonymous visitors are sent to the login page; only owners
create and revoke keys."""

import re

import pytest
from django.contrib.auth import SESSION_KEY
from django.urls import URLPattern, URLResolver, get_resolver

from accounts.models import ApiKey, Membership
from accounts.services import api_key_create
from tests.support.factories import MembershipFactory, UserFactory

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

PASSWORD = "pw-for-tests-only"  # tests.support.factories.UserFactory


def portal_routes() -> list[str]:
    """Every portal route below /portal/<slug>/, e.g. "/portal/{slug}/invoices/{pk}/"."""
    (portal,) = [
        p
        for p in get_resolver().url_patterns
        if isinstance(p, URLResolver) and p.namespace == "portal"
    ]
    routes = []

    def walk(patterns, prefix):
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern):
                routes.append("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route))

    walk(portal.url_patterns, str(portal.pattern))
    return [route for route in routes if "{slug}" in route]


def paths_of(side) -> list[str]:
    """Every portal URL filled with this side's customer and objects."""
    values = {
        "slug": side.customer.slug,
        "format_name": "csv",
    }
    # A person of the customer's who is not its owner (the one an owner could remove).
    person = side.customer.memberships.exclude(role=Membership.Role.OWNER).order_by("pk").first()
    paths = []
    for route in portal_routes():
        # The one object a route names: a key under keys/, a person under people/, else the
        # invoice.
        if "/keys/" in route:
            pk = side.key.pk
        elif "/people/" in route:
            pk = person.pk if person is not None else 0
        else:
            pk = side.invoice.pk
        paths.append(route.format(pk=pk, **values))
    return paths


def test_the_walk_finds_every_page(world):
    paths = paths_of(world["acme"])
    for page in ("usage", "keys", "people", "limits", "invoices"):
        assert f"/portal/acme/{page}/" in paths, page
    assert any(path.endswith("/revoke") for path in paths)
    assert any(path.endswith("/remove") for path in paths)
    assert any("/download/csv" in path for path in paths)
    assert all("{" not in path for path in paths), paths


def test_anonymous_visitors_are_sent_to_the_login_page(client, world):
    for path in ["/portal/", *paths_of(world["acme"])]:
        for method in (client.get, client.post):
            response = method(path)
            assert response.status_code == 302, (path, response.status_code)
            assert response["Location"].startswith("/login/?next=/portal/"), path


def test_another_customers_pages_answer_404_to_every_method(client, world, outsider):
    """globex's owner, signed in, on every acme URL: as if acme did not exist."""
    client.force_login(outsider)
    for path in paths_of(world["acme"]):
        for method in (client.get, client.post):
            response = method(path)
            assert response.status_code == 404, (path, method, response.status_code)
    # Nothing of acme's changed by the attempts.
    assert ApiKey.objects.get(pk=world["acme"].key.pk).revoked_at is None
    assert ApiKey.objects.filter(customer__slug="acme").count() == 1
    # Its own pages it reaches.
    assert client.get("/portal/globex/").status_code == 200


def test_another_customers_objects_under_ones_own_slug_answer_404(client, world, owner):
    """acme's owner with globex's key and invoice ids in acme's URLs."""
    client.force_login(owner)
    globex = world["globex"]
    assert client.get(f"/portal/acme/invoices/{globex.invoice.pk}/").status_code == 404
    download = client.get(f"/portal/acme/invoices/{globex.invoice.pk}/download/csv")
    assert download.status_code == 404
    assert client.post(f"/portal/acme/keys/{globex.key.pk}/revoke").status_code == 404
    assert ApiKey.objects.get(pk=globex.key.pk).revoked_at is None


def test_members_and_viewers_read_every_page_and_change_no_key_or_person(
    client, world, acme, member
):
    viewer = MembershipFactory(customer=acme, role=Membership.Role.VIEWER).user
    acme_key = world["acme"].key
    people = set(Membership.objects.filter(customer=acme).values_list("pk", "role"))
    for user in (member, viewer):
        client.force_login(user)
        for path in paths_of(world["acme"]):
            if path.endswith(("/keys/new", "/revoke", "/remove")):
                continue
            assert client.get(path).status_code == 200, (user, path)
        created = client.post("/portal/acme/keys/new", {"name": "mine", "scopes": ["read"]})
        assert created.status_code == 403
        revoked = client.post(f"/portal/acme/keys/{acme_key.pk}/revoke")
        assert revoked.status_code == 403
        keys_page = client.get("/portal/acme/keys/").content.decode()
        assert 'aria-label="New API key"' not in keys_page
        assert "its owners create and revoke them" in keys_page
        for pk, _ in people:
            removed = client.post(f"/portal/acme/people/{pk}/remove", {"revoke_keys": "on"})
            assert removed.status_code == 403
        people_page = client.get("/portal/acme/people/").content.decode()
        assert 'aria-label="Remove' not in people_page
        assert "its owners remove them" in people_page
    assert list(ApiKey.objects.filter(customer=acme)) == [acme_key]
    assert ApiKey.objects.get(pk=acme_key.pk).revoked_at is None
    assert set(Membership.objects.filter(customer=acme).values_list("pk", "role")) == people


def test_an_owner_creates_a_key_seen_once_and_revokes_it(client, world, acme, owner):
    client.force_login(owner)
    response = client.post(
        "/portal/acme/keys/new", {"name": "ci runner", "scopes": ["read", "admission"]}
    )
    assert response.status_code == 201
    key = ApiKey.objects.get(customer=acme, name="ci runner")
    plaintext = response.context["new_key"].plaintext
    prefix, _, secret = plaintext.partition(".")
    assert key.prefix == prefix and secret and secret not in key.secret_sha256
    assert plaintext in response.content.decode()
    assert key.created_by == owner and set(key.scopes) == {"read", "admission"}
    # Once: the list shows the prefix, never the secret.
    again = client.get("/portal/acme/keys/").content.decode()
    assert prefix in again and secret not in again
    # The key works against the API as acme, and only until it is revoked.
    api = {"HTTP_AUTHORIZATION": f"Bearer {plaintext}"}
    assert client.get("/api/v1/me", **api).status_code == 200
    revoked = client.post(f"/portal/acme/keys/{key.pk}/revoke", follow=True)
    assert b"revoked: it no longer authenticates" in revoked.content
    assert client.get("/api/v1/me", **api).status_code == 401


def test_an_owner_sees_the_keys_each_person_made_and_removes_a_member_with_them(
    client, world, acme, owner, member
):
    """Keys a member made outlive the member, unless their removal takes them too (issue 34)."""
    members_key = api_key_create(name="member's laptop", customer=acme, created_by=member)
    client.force_login(owner)
    page = client.get("/portal/acme/people/").content.decode()
    member_row = page.split('data-testid="person-member"')[1].split("</tr>")[0]
    assert members_key.api_key.prefix in member_row
    assert "Also revoke the 1 key this person made" in member_row
    # An owner does not remove themselves (the customer would be left without one).
    owner_row = page.split('data-testid="person-owner"')[1].split("</tr>")[0]
    assert 'aria-label="Remove owner"' not in owner_row and ">you<" in owner_row
    mine = Membership.objects.get(user=owner, customer=acme)
    refused = client.post(f"/portal/acme/people/{mine.pk}/remove", follow=True)
    assert "You cannot remove yourself" in refused.content.decode()
    assert Membership.objects.filter(pk=mine.pk).exists()

    theirs = Membership.objects.get(user=member, customer=acme)
    removed = client.post(
        f"/portal/acme/people/{theirs.pk}/remove", {"revoke_keys": "on"}, follow=True
    )
    assert "The 1 key(s) they made are revoked" in removed.content.decode()
    api = {"HTTP_AUTHORIZATION": f"Bearer {members_key.plaintext}"}
    assert client.get("/api/v1/me", **api).status_code == 401
    # The member is gone from acme: its pages answer them as a stranger's.
    client.force_login(member)
    assert client.get("/portal/acme/").status_code == 404


def test_a_key_the_service_refuses_says_why_on_its_field(client, world, owner):
    """acme may not report its own usage, so its keys cannot hold usage:write: a 400 that says
    so, not a 500, and no key."""
    client.force_login(owner)
    response = client.post("/portal/acme/keys/new", {"name": "self", "scopes": ["usage:write"]})
    assert response.status_code == 400
    assert "may not report its own usage" in response.content.decode()
    assert not ApiKey.objects.filter(name="self").exists()
    blank = client.post("/portal/acme/keys/new", {"name": "", "scopes": ["read"]})
    assert blank.status_code == 400 and "This field is required" in blank.content.decode()


def test_a_user_of_several_customers_picks_one(client, world, acme, globex):
    both = UserFactory(username="consultant")
    MembershipFactory(user=both, customer=acme, role=Membership.Role.MEMBER)
    MembershipFactory(user=both, customer=globex, role=Membership.Role.OWNER)
    client.force_login(both)
    home = client.get("/portal/")
    assert home.status_code == 200
    body = home.content.decode()
    assert 'href="/portal/acme/"' in body and 'href="/portal/globex/"' in body
    # The role is per customer: an owner of globex, a member of acme.
    assert client.post("/portal/acme/keys/new", {"name": "x"}).status_code == 403
    created = client.post("/portal/globex/keys/new", {"name": "x", "scopes": ["read"]})
    assert created.status_code == 201


def test_the_sites_login_leads_a_customers_user_to_its_portal(client, world, owner, planner):
    response = client.post("/login/", {"username": "owner", "password": PASSWORD}, follow=True)
    assert response.redirect_chain[-1][0] == "/portal/acme/"
    assert response.status_code == 200
    client.logout()
    # A planner belongs to the planner UI (the same login page, no customer of its own).
    planner.set_password(PASSWORD)
    planner.save()
    response = client.post("/login/", {"username": "planner", "password": PASSWORD}, follow=True)
    assert response.redirect_chain[-1][0] == "/planner/"


def test_a_user_of_no_customer_is_told_so(client, db):
    client.force_login(UserFactory(username="stray"))
    response = client.get("/portal/")
    assert response.status_code == 200
    assert b"Your account belongs to no customer." in response.content
    assert client.get("/portal/acme/").status_code == 404


def test_the_portals_login_locks_like_the_planners(client, world, owner, settings):
    """django-axes guards the one login page: too many wrong passwords for a customer's user,
    and the right one is refused too."""
    settings.AXES_FAILURE_LIMIT = 3
    for _ in range(3):
        client.post("/login/", {"username": "owner", "password": "wrong"})
    right = client.post("/login/", {"username": "owner", "password": PASSWORD})
    assert right.status_code == 429
    assert SESSION_KEY not in client.session

"""Only staff planners reach planner pages: every URL of the planner UI, whatever section
added it, refuses customers' users and sends anonymous visitors to the login page."""

import re

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from tests.conftest import _client_for_key

pytestmark = pytest.mark.django_db

SAMPLE_ARGS = {"int": "1", "slug": "acme", "str": "x", "path": "x"}


def planner_paths() -> list[str]:
    """Every planner URL, with sample values for its arguments."""
    resolver = get_resolver()
    (planner,) = [
        p for p in resolver.url_patterns if isinstance(p, URLResolver) and p.namespace == "planner"
    ]
    paths = []

    def walk(patterns, prefix):
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern):
                route = re.sub(
                    r"<(?:(\w+):)?\w+>", lambda m: SAMPLE_ARGS.get(m[1] or "str", "1"), route
                )
                paths.append("/" + route)

    walk(planner.url_patterns, str(planner.pattern))
    return paths


def test_the_walk_finds_every_section():
    paths = planner_paths()
    for section in ("customers", "benchmarks", "allocation", "what-if", "invoices"):
        assert any(path.startswith(f"/planner/{section}/") for path in paths), section
    assert all("<" not in path for path in paths), paths


def test_anonymous_visitors_are_sent_to_the_login_page(client):
    for path in planner_paths():
        for method in (client.get, client.post):
            response = method(path)
            assert response.status_code == 302, (path, response.status_code)
            assert response["Location"].startswith("/login/?next="), path


def test_a_customers_owner_reaches_no_planner_page(owner_client):
    for path in planner_paths():
        for method in (owner_client.get, owner_client.post):
            response = method(path)
            assert response.status_code == 403, (path, response.status_code)


def test_staff_who_are_not_planners_reach_no_planner_page(client, django_user_model):
    staff = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    client.force_login(staff)
    for path in planner_paths():
        assert client.get(path).status_code == 403, path


def test_an_api_key_opens_no_planner_page(make_key, acme):
    """Keys are for the API: even a service key with every scope gets the login page."""
    from accounts import scopes as S

    _, plaintext = make_key(service_name="gateway", scopes=list(S.SERVICE_SCOPES))
    client = _client_for_key(plaintext)
    for path in planner_paths():
        response = client.get(path)
        assert response.status_code == 302, path
        assert response["Location"].startswith("/login/"), path


def test_a_planner_logs_in_with_the_form(client, planner):
    planner.set_password("s3cret-planner")
    planner.save()
    response = client.post(
        "/login/", {"username": "planner", "password": "s3cret-planner", "next": "/planner/"}
    )
    assert response.status_code == 302 and response["Location"] == "/planner/"
    assert client.get("/planner/").status_code == 200
    # The site's root leads to the planner UI.
    assert client.get("/")["Location"] == "/planner/"


def test_a_wrong_password_says_so(client, planner):
    response = client.post("/login/", {"username": "planner", "password": "nope"})
    assert response.status_code == 200
    assert b"didn&#x27;t match" in response.content or b"didn't match" in response.content

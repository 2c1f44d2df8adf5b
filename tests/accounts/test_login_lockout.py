"""Password logins lock per (username, client address) after too many failures, and per username
alone after more, from any addresses; API keys are not passwords and never lock."""

import pytest
from django.contrib.auth import SESSION_KEY

from accounts import scopes as S
from tests.controlplane.test_deploy_files import production_app_env
from tests.support.factories import UserFactory

pytestmark = pytest.mark.django_db

LOGIN_PAGES = ["/login/", "/admin/login/"]
PASSWORD = "pw-for-tests-only"  # tests.support.factories.UserFactory


@pytest.fixture(autouse=True)
def _lockout_settings(settings):
    settings.AXES_FAILURE_LIMIT = 5
    settings.LOGIN_USERNAME_FAILURE_LIMIT = 10
    settings.TRUSTED_PROXY_COUNT = 0
    # Dozens of password checks: a fast hasher keeps them cheap (the lock is what is tested).
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff(db):
    return UserFactory(username="alice", is_staff=True, is_superuser=True)


def attempt(client, page, username, password, **meta):
    return client.post(page, {"username": username, "password": password}, **meta)


def fail(client, page, username, times, **meta):
    return [attempt(client, page, username, "wrong-password", **meta) for _ in range(times)]


@pytest.mark.parametrize("page", LOGIN_PAGES)
def test_thirty_wrong_passwords_lock_the_login_and_the_right_one_is_then_refused(
    client, staff, page
):
    responses = fail(client, page, "alice", 30)
    assert responses[0].status_code == 200  # the form again, with an error
    assert responses[-1].status_code == 429

    right = attempt(client, page, "alice", PASSWORD)
    assert right.status_code == 429
    assert b"Too many failed logins" in right.content
    assert SESSION_KEY not in client.session


@pytest.mark.parametrize("page", LOGIN_PAGES)
def test_the_lock_starts_at_the_failure_limit_not_before(client, staff, page):
    fail(client, page, "alice", 4)
    assert attempt(client, page, "alice", PASSWORD).status_code == 302
    client.logout()

    fail(client, page, "alice", 5)  # the successful login reset the count
    assert attempt(client, page, "alice", PASSWORD).status_code == 429


def test_the_same_user_from_another_address_behind_the_trusted_proxy_still_logs_in(
    client, staff, settings
):
    settings.TRUSTED_PROXY_COUNT = 1
    proxy = {"REMOTE_ADDR": "10.0.0.2"}
    fail(client, "/login/", "alice", 6, HTTP_X_FORWARDED_FOR="203.0.113.5", **proxy)
    locked = attempt(
        client, "/login/", "alice", PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.5", **proxy
    )
    assert locked.status_code == 429

    elsewhere = attempt(
        client, "/login/", "alice", PASSWORD, HTTP_X_FORWARDED_FOR="198.51.100.9", **proxy
    )
    assert elsewhere.status_code == 302
    assert client.session[SESSION_KEY] == str(staff.pk)


def test_a_client_behind_the_proxy_cannot_escape_its_lock_by_writing_x_forwarded_for(
    client, staff, settings
):
    settings.TRUSTED_PROXY_COUNT = 1
    proxy = {"REMOTE_ADDR": "10.0.0.2"}
    fail(client, "/login/", "alice", 6, HTTP_X_FORWARDED_FOR="203.0.113.5", **proxy)
    # The client wrote its own X-Forwarded-For; the proxy appended the address it saw.
    spoofed = attempt(
        client,
        "/login/",
        "alice",
        PASSWORD,
        HTTP_X_FORWARDED_FOR="198.51.100.77, 203.0.113.5",
        **proxy,
    )
    assert spoofed.status_code == 429


def test_without_a_trusted_proxy_x_forwarded_for_is_ignored(client, staff):
    fail(client, "/login/", "alice", 6, REMOTE_ADDR="203.0.113.5")
    spoofed = attempt(
        client,
        "/login/",
        "alice",
        PASSWORD,
        REMOTE_ADDR="203.0.113.5",
        HTTP_X_FORWARDED_FOR="198.51.100.9",
    )
    assert spoofed.status_code == 429


def test_another_user_from_the_same_address_is_not_locked(client, staff):
    bob = UserFactory(username="bob", is_staff=True)
    fail(client, "/login/", "alice", 6)
    assert attempt(client, "/login/", "alice", PASSWORD).status_code == 429

    assert attempt(client, "/login/", "bob", PASSWORD).status_code == 302
    assert client.session[SESSION_KEY] == str(bob.pk)


def test_api_keys_are_not_passwords_and_work_from_a_locked_address(client, staff, make_key):
    from accounts.models import Customer

    fail(client, "/login/", "alice", 6)
    assert attempt(client, "/login/", "alice", PASSWORD).status_code == 429

    acme = Customer.objects.create(name="Acme", slug="acme")
    _, plaintext = make_key(customer=acme, scopes=[S.READ])
    for _ in range(10):
        wrong = client.get("/api/v1/me", HTTP_AUTHORIZATION="Bearer abcdefgh.wrong-secret")
        assert wrong.status_code == 401
    right = client.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert right.status_code == 200
    assert right.json()["kind"] == "api_key"


# The proxy count the shipped compose setup runs web with (deploy/compose.yaml with
# deploy/production.env.example), and none.
PROXY_COUNTS = [int(production_app_env()["TRUSTED_PROXY_COUNT"]), 0]


@pytest.mark.parametrize("proxies", PROXY_COUNTS)
def test_twelve_wrong_passwords_under_twelve_forwarded_addresses_lock_the_login(
    client, staff, settings, proxies
):
    """Issue 34: a client that reaches web without the proxy writes a new X-Forwarded-For on
    every guess. Whatever web makes of the header, the guesses lock the username."""
    settings.TRUSTED_PROXY_COUNT = proxies
    direct = {"REMOTE_ADDR": "203.0.113.66"}
    answers = [
        attempt(client, "/login/", "alice", "wrong-password",
                HTTP_X_FORWARDED_FOR=f"198.51.100.{guess}", **direct).status_code
        for guess in range(12)
    ]  # fmt: skip
    assert 429 in answers, answers

    right = attempt(
        client, "/login/", "alice", PASSWORD, HTTP_X_FORWARDED_FOR="192.0.2.1", **direct
    )
    assert right.status_code == 429
    assert SESSION_KEY not in client.session


def test_guesses_spread_over_many_addresses_lock_the_username_at_its_own_limit(client, staff):
    """Each address stays under the per-address limit; the username's own limit (higher, so
    that one address's typos never lock the user everywhere) still ends the guessing."""
    for guess in range(9):
        fail(client, "/login/", "alice", 1, REMOTE_ADDR=f"198.51.100.{guess}")
    # Nine failures: under the username's limit, so alice still logs in (and the count resets).
    assert attempt(client, "/login/", "alice", PASSWORD, REMOTE_ADDR="192.0.2.1").status_code == 302
    client.logout()

    answers = [
        fail(client, "/login/", "alice", 1, REMOTE_ADDR=f"198.51.100.{guess}")[0].status_code
        for guess in range(10)
    ]
    assert answers[:9] == [200] * 9  # the form again, with its error
    assert answers[9] == 429
    refused = attempt(client, "/login/", "alice", PASSWORD, REMOTE_ADDR="192.0.2.1")
    assert refused.status_code == 429

    # Other users are not locked with alice.
    UserFactory(username="bob", is_staff=True)
    assert attempt(client, "/login/", "bob", PASSWORD, REMOTE_ADDR="192.0.2.1").status_code == 302

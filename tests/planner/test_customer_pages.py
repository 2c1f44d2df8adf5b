"""The customers pages: list with reserved versus used, a customer's reservations and keys."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.keys import hash_secret
from accounts.models import ApiKey, Customer
from capacity.models import Reservation, UsageMinute
from capacity.selling.reservations import reservation_create

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def queries(client, path):
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content[:300]
    return len(captured), response


def test_an_empty_list_says_how_to_start(planner_client):
    response = planner_client.get("/planner/customers/")
    assert response.status_code == 200
    assert b"No customers yet." in response.content


def test_the_list_shows_reserved_used_and_refusals(planner_client, acme, globex, sellable):
    served_model = sellable.served_model
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=120)
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    # 1440 MU over the last day is 1 MU/min on average; 3 refusals, 2 of them guaranteed.
    UsageMinute.objects.create(
        customer=acme,
        served_model=served_model,
        minute=minute,
        requests=10,
        refused_requests=3,
        guaranteed_refused_requests=2,
        mu=1440.0,
    )
    # Usage older than a day does not count.
    UsageMinute.objects.create(
        customer=globex, served_model=served_model, minute=minute - timedelta(days=2), mu=999.0
    )
    response = planner_client.get("/planner/customers/")
    rows = {
        row.split("</td>")[0]: row
        for row in response.content.decode().split('<a href="/planner/customers/')[1:]
    }
    acme_row = next(row for key, row in rows.items() if key.startswith("acme/"))
    globex_row = next(row for key, row in rows.items() if key.startswith("globex/"))
    assert ">120.0<" in acme_row and ">1.00<" in acme_row and ">3<" in acme_row
    assert ">2<" in acme_row
    assert ">0.00<" in globex_row


def test_the_list_searches_and_pages_through_ten_thousand_customers(planner_client):
    Customer.objects.bulk_create(
        [Customer(name=f"Customer {i:05d}", slug=f"c{i:05d}") for i in range(10_000)]
    )
    count, response = queries(planner_client, "/planner/customers/?page=3")
    assert b"Page 3 of 200 (10000 in all)" in response.content
    assert b"c00100" in response.content and b"c00150" not in response.content
    count_last, response = queries(planner_client, "/planner/customers/?page=200")
    assert b"c09999" in response.content
    assert count_last == count
    _, response = queries(planner_client, "/planner/customers/?q=c0424")
    assert b"c04240" in response.content and b"c04250" not in response.content


def test_the_list_costs_the_same_queries_for_few_and_many_customers(planner_client, sellable):
    served_model = sellable.served_model

    def grow(n, start):
        for i in range(start, start + n):
            customer = Customer.objects.create(name=f"C{i}", slug=f"c{i}")
            reservation_create(customer=customer, served_model=served_model, mu_per_minute=1)
            UsageMinute.objects.create(
                customer=customer, served_model=served_model, minute=timezone.now(), mu=1
            )

    grow(2, 0)
    few, _ = queries(planner_client, "/planner/customers/")
    grow(30, 2)
    many, response = queries(planner_client, "/planner/customers/")
    assert many == few
    assert response.content.count(b'<a href="/planner/customers/c') == 32


def test_creating_a_customer_and_a_duplicate(planner_client):
    response = planner_client.post(
        "/planner/customers/", {"name": "Initech", "slug": "initech", "tier": "premium"}
    )
    assert response.status_code == 302 and response["Location"] == "/planner/customers/initech/"
    assert Customer.objects.get(slug="initech").tier_id == "premium"
    # Each customer's tier is shown, on the list and on its page.
    listed = planner_client.get("/planner/customers/").content.decode()
    assert "<td>Premium</td>" in listed
    assert "initech · Premium" in planner_client.get("/planner/customers/initech/").content.decode()
    response = planner_client.post(
        "/planner/customers/", {"name": "Other", "slug": "initech", "tier": "standard"}
    )
    assert response.status_code == 400
    assert b"A customer with slug &#x27;initech&#x27; already exists." in response.content
    response = planner_client.post("/planner/customers/", {"name": "", "slug": "Not a slug!"})
    assert response.status_code == 400
    assert b"This field is required." in response.content
    assert Customer.objects.count() == 1


def test_a_customer_page_with_nothing_yet(planner_client, acme):
    response = planner_client.get("/planner/customers/acme/")
    assert response.status_code == 200
    for text in (b"No reservations and no usage yet.", b"No reservations.", b"No API keys."):
        assert text in response.content
    assert planner_client.get("/planner/customers/nobody/").status_code == 404


def test_the_utilisation_chart_has_reserved_as_a_line_and_used_as_an_area(
    planner_client, acme, sellable
):
    served_model = sellable.served_model
    reservation_create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=60,
        starts_at=timezone.now() - timedelta(hours=2),
    )
    UsageMinute.objects.create(
        customer=acme,
        served_model=served_model,
        minute=timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=30),
        mu=300.0,
    )
    response = planner_client.get("/planner/customers/acme/?range=24h")
    chart = response.context["chart"]
    reserved, used = chart["data"]["datasets"]
    assert reserved["label"] == "Reserved MU/min" and "fill" not in reserved
    assert used["label"] == "Used MU/min" and used["fill"] == "origin"
    assert max(reserved["data"]) == 60
    # 300 MU in one minute of a 10-minute bucket: 30 MU/min on average in that bucket.
    assert max(used["data"]) == 30
    assert len(chart["data"]["labels"]) == 144
    assert b'data-chart="utilisation"' in response.content


def test_a_reservation_the_fleet_cannot_serve_shows_the_shortfall(planner_client, acme, sellable):
    response = planner_client.post(
        "/planner/customers/acme/reservations/",
        {"served_model": sellable.served_model.pk, "mu_per_minute": "1000"},
    )
    assert response.status_code == 409
    text = response.content.decode()
    assert "The reservation was refused." in text
    assert "Shortfall: <strong>280.00 MU/min</strong>" in text
    assert "Sellable: 720.00 MU/min" in text
    assert not Reservation.objects.exists()
    # The form keeps what was typed.
    assert 'value="1000' in text


def test_reserve_amend_and_cancel(planner_client, acme, sellable):
    model_pk = sellable.served_model.pk
    response = planner_client.post(
        "/planner/customers/acme/reservations/",
        {"served_model": model_pk, "mu_per_minute": "100", "keep_warm": "on"},
    )
    assert response.status_code == 302
    reservation = Reservation.objects.get()
    assert reservation.mu_per_minute == 100 and reservation.keep_warm
    assert reservation.changes.get().changed_by == "planner:planner"

    response = planner_client.post(
        f"/planner/customers/acme/reservations/{reservation.pk}/amend",
        {"mu_per_minute": "5000"},
        follow=True,
    )
    assert b"was not amended" in response.content and b"missing" in response.content
    reservation.refresh_from_db()
    assert reservation.mu_per_minute == 100

    planner_client.post(
        f"/planner/customers/acme/reservations/{reservation.pk}/amend", {"mu_per_minute": "150"}
    )
    reservation.refresh_from_db()
    assert reservation.mu_per_minute == 150

    response = planner_client.post(
        f"/planner/customers/acme/reservations/{reservation.pk}/cancel", follow=True
    )
    assert b"cancelled" in response.content
    reservation.refresh_from_db()
    assert reservation.status == Reservation.Status.CANCELLED
    response = planner_client.post(
        f"/planner/customers/acme/reservations/{reservation.pk}/cancel", follow=True
    )
    assert b"already cancelled" in response.content


def test_another_customers_reservation_or_key_is_not_reachable_through_this_customer(
    planner_client, acme, globex, sellable, make_key
):
    theirs = reservation_create(
        customer=globex, served_model=sellable.served_model, mu_per_minute=10
    )
    key, _ = make_key(customer=globex)
    assert (
        planner_client.post(f"/planner/customers/acme/reservations/{theirs.pk}/cancel").status_code
        == 404
    )
    assert (
        planner_client.post(f"/planner/customers/acme/api-keys/{key.pk}/revoke").status_code == 404
    )
    theirs.refresh_from_db()
    key.refresh_from_db()
    assert theirs.status != Reservation.Status.CANCELLED and key.revoked_at is None


def test_a_new_key_is_shown_once_and_kept_hashed(planner_client, acme):
    response = planner_client.post(
        "/planner/customers/acme/api-keys/", {"name": "gateway", "scopes": ["read", "admission"]}
    )
    assert response.status_code == 201
    plaintext = response.context["new_key"].plaintext
    assert plaintext.encode() in response.content
    key = ApiKey.objects.get(customer=acme)
    prefix, _, secret = plaintext.partition(".")
    assert key.prefix == prefix and key.secret_sha256 == hash_secret(secret)
    assert key.scopes == ["read", "admission"]
    again = planner_client.get("/planner/customers/acme/")
    assert plaintext.encode() not in again.content and secret.encode() not in again.content
    assert prefix.encode() in again.content

    response = planner_client.post("/planner/customers/acme/api-keys/", {"name": "", "scopes": []})
    assert response.status_code == 400
    assert b"This field is required." in response.content
    assert ApiKey.objects.count() == 1

    response = planner_client.post(f"/planner/customers/acme/api-keys/{key.pk}/revoke", follow=True)
    assert b"revoked" in response.content
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_the_customer_page_says_which_models_its_keys_may_use(planner_client, acme, served_model):
    from capacity.selling.entitlements import entitlements_set

    page = planner_client.get("/planner/customers/acme/")
    assert b"Models its keys may use:\n  <strong>none</strong>" in page.content

    entitlements_set(customer=acme, served_models=[served_model], actor="test")

    page = planner_client.get("/planner/customers/acme/")
    assert b"<strong>llama-8b</strong>" in page.content


def test_a_planner_sets_and_removes_request_limits_on_the_customer_page(
    planner_client, acme, globex, django_capture_on_commit_callbacks
):
    from accounts.services import api_key_create
    from capacity.models import RequestLimit
    from core.models import AuditEntry

    key = api_key_create(customer=acme, name="app").api_key
    theirs = api_key_create(customer=globex, name="other").api_key
    with django_capture_on_commit_callbacks(execute=True):
        response = planner_client.post(
            "/planner/customers/acme/request-limits/",
            {"api_key": key.prefix, "requests_per_minute": "60", "concurrent_requests": "4"},
            follow=True,
        )
    assert response.status_code == 200
    limit = RequestLimit.objects.get(customer=acme)
    assert (limit.api_key, limit.requests_per_minute, limit.tokens_per_minute) == (key, 60, None)
    assert b"Request limits of Acme" in response.content
    assert key.prefix.encode() in response.content
    assert AuditEntry.objects.filter(action="request_limit.create").count() == 1

    # Another customer's key is no choice here, and a limit below 1 is marked on its field.
    wrong = planner_client.post(
        "/planner/customers/acme/request-limits/",
        {"api_key": theirs.prefix, "requests_per_minute": "0"},
    )
    assert wrong.status_code == 400
    assert set(wrong.context["limit_form"].errors) == {"api_key", "requests_per_minute"}

    # Not reachable through another customer's page; removed through its own.
    assert (
        planner_client.post(f"/planner/customers/globex/request-limits/{limit.pk}/delete")
    ).status_code == 404
    planner_client.post(f"/planner/customers/acme/request-limits/{limit.pk}/delete")
    assert not RequestLimit.objects.exists()
    assert AuditEntry.objects.filter(action="request_limit.delete").count() == 1


# --- A customer's people and the keys each made (issue 34, finding 6) ------------------------


def test_the_customer_page_lists_the_keys_each_person_made_and_removing_one_offers_to_revoke_them(
    planner_client, acme, globex, owner, member, key_client
):
    from accounts.models import Membership
    from accounts.services import api_key_create
    from core.models import AuditEntry

    ci = api_key_create(name="ci", customer=acme, created_by=member)
    laptop = api_key_create(name="laptop", customer=acme, created_by=member)
    owners = api_key_create(name="prod", customer=acme, created_by=owner)
    page = planner_client.get("/planner/customers/acme/").content.decode()
    member_row = page.split('data-testid="person-member"')[1].split("</tr>")[0]
    assert ci.api_key.prefix in member_row and laptop.api_key.prefix in member_row
    assert owners.api_key.prefix not in member_row
    assert "Also revoke the 2 keys this person made" in member_row
    assert 'name="revoke_keys" checked' in member_row  # offered, on unless unticked
    assert owners.api_key.prefix in page.split('data-testid="person-owner"')[1].split("</tr>")[0]

    # Another customer's page does not reach acme's people.
    theirs = Membership.objects.get(user=member, customer=acme)
    assert (
        planner_client.post(f"/planner/customers/globex/people/{theirs.pk}/remove").status_code
        == 404
    )

    removed = planner_client.post(
        f"/planner/customers/acme/people/{theirs.pk}/remove", {"revoke_keys": "on"}, follow=True
    )
    assert "member (member) removed from Acme. The 2 key(s) they made are revoked" in (
        removed.content.decode()
    )
    assert not Membership.objects.filter(pk=theirs.pk).exists()
    for created in (ci, laptop):
        assert key_client(created.plaintext).get("/api/v1/me").status_code == 401
    # The customer's history says who left and which keys went with them.
    history = removed.content.decode().split('<section aria-label="History">')[1]
    assert "membership.remove" in history and ci.api_key.prefix in history

    # Unticked, the owner's removal keeps the key they made working.
    mine = Membership.objects.get(user=owner, customer=acme)
    kept = planner_client.post(f"/planner/customers/acme/people/{mine.pk}/remove", follow=True)
    assert "The 1 key(s) they made keep working" in kept.content.decode()
    assert key_client(owners.plaintext).get("/api/v1/me").status_code == 200
    assert AuditEntry.objects.filter(action="membership.remove").count() == 2


def test_the_people_list_costs_the_same_queries_for_few_and_many_people_and_keys(
    planner_client, acme
):
    from accounts.services import api_key_create
    from tests.support.factories import MembershipFactory

    def grow(n):
        for _ in range(n):
            user = MembershipFactory(customer=acme).user
            made = api_key_create(
                name="k", customer=acme, scopes=["read", "write"], created_by=user
            )
            api_key_create(name="kk", customer=acme, scopes=["read"], created_by_key=made.api_key)

    grow(1)
    few, _ = queries(planner_client, "/planner/customers/acme/")
    grow(15)
    many, response = queries(planner_client, "/planner/customers/acme/")
    assert response.content.decode().count('aria-label="Remove ') == 16
    assert many == few

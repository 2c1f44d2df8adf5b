"""Every planner page, fed query strings no form sends, answers a page or a 404, never 500
(issue 34, finding 11): digits str.isdigit() passes and int() refuses ('²'), a year no date
holds, control characters."""

from datetime import date

import pytest

from tests.planner.test_access import planner_paths
from tests.planner.test_fleet_allocation_invoice_pages import invoice_for
from tests.support.factories import CustomerFactory

pytestmark = pytest.mark.django_db

GARBAGE_QUERIES = [
    {"period": "2026-²"},
    {"period": "²²²²-1"},
    {"model": "²"},
    {"period": "99999999999-1", "model": "99999999999999999999999", "version": "²"},
    {"page": "²", "range": "²", "object_id": "²", "status": "²", "all": "²", "q": "²"},
    {"period": "2026-11\x00", "model": "1\x00", "q": "a\x00b", "page": "1\n"},
]


def test_no_planner_page_answers_500_to_a_garbage_query(
    planner_client, acme, served_model, deployment
):
    planner_client.raise_request_exception = False
    checked = 0
    for path in planner_paths():
        for query in GARBAGE_QUERIES:
            response = planner_client.get(path, query)
            assert response.status_code < 500, (path, query, response.status_code)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("period", ["2026-²", "²²²²-1", "99999999999-1", "2026-13", "0000-01"])
def test_an_invoice_period_that_is_not_a_month_matches_nothing_and_says_why(planner_client, period):
    invoice_for(CustomerFactory())
    response = planner_client.get("/planner/invoices/", {"period": period})
    assert response.status_code == 200
    assert not response.context["page"].object_list
    text = response.content.decode()
    assert "No invoice matches these filters." in text
    assert "is not a month" in text


def test_an_invoice_period_of_one_digit_month_still_filters(planner_client):
    september = invoice_for(CustomerFactory(), period=date(2026, 9, 1))
    october = invoice_for(CustomerFactory(), period=date(2026, 10, 1))
    for period, invoice in (("2026-10", october), ("2026-9", september), ("2026-09", september)):
        response = planner_client.get("/planner/invoices/", {"period": period})
        assert list(response.context["page"].object_list) == [invoice], period


def test_a_what_if_for_a_model_that_is_not_a_number_starts_blank(planner_client, served_model):
    response = planner_client.get("/planner/what-if/", {"model": "²"})
    assert response.status_code == 200
    assert response.context["form"]["served_model"].value() is None

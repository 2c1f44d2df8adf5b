"""Receipts: a customer reads back the usage events its invoice is built on
(`GET /api/v1/usage/events`, by cursor, and its CSV), and only its own."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing.generation import invoice_generate
from billing.models import Invoice
from billing.rates import rate_card_create
from capacity.metering.rollups import usage_rollup
from capacity.models import Reservation, UsageEvent
from tests.conftest import make_cost_model
from tests.support.factories import ServedModelFactory
from tests.support.usage import USAGE, gateway_client, generate_events, post_usage, store_events

pytestmark = pytest.mark.django_db

START = datetime(2026, 11, 1, tzinfo=UTC)


def page_through(client, url: str, *, page_size: int) -> list[dict]:
    """Every receipt behind `url`, following the next links; fails on a repeated page."""
    receipts, seen_links = [], set()
    link = f"{url}{'&' if '?' in url else '?'}page_size={page_size}"
    while link:
        assert link not in seen_links
        seen_links.add(link)
        response = client.get(link)
        assert response.status_code == 200, response.json()
        body = response.json()
        assert len(body["results"]) <= page_size
        receipts += body["results"]
        link = body["next"]
    return receipts


@pytest.mark.postgresql_only
def test_a_customer_pages_through_100000_events_and_gets_exactly_its_own(
    served_model, gpu_type, acme, globex, make_key, key_client
):
    cost_model = make_cost_model(served_model, gpu_type)
    # Ten events a second, acme's and globex's finishing at the very same instants: page
    # boundaries fall inside runs of equal finished_at, which paging on time alone mishandles.
    made = {"served_model": served_model, "cost_model": cost_model, "start": START}
    generate_events(customer=acme, count=100_000, prefix="a-", **made)
    generate_events(customer=globex, count=100_000, every=5, prefix="g-", **made)
    _, plaintext = make_key(customer=acme)
    receipts = page_through(key_client(plaintext), USAGE, page_size=1000)

    ids = [receipt["event_id"] for receipt in receipts]
    assert len(ids) == 100_000
    assert set(ids) == {f"a-{n}" for n in range(100_000)}
    assert {receipt["customer"] for receipt in receipts} == {"acme"}
    # Newest first, and the MU each was stored with.
    finished = [receipt["finished_at"] for receipt in receipts]
    assert finished == sorted(finished, reverse=True)
    assert sum(receipt["mu"] for receipt in receipts) == sum(1.0 + n % 7 for n in range(100_000))
    # globex, on the same table at the same moments, sees its 20,000 and none of acme's.
    _, globex_key = make_key(customer=globex)
    first = key_client(globex_key).get(f"{USAGE}?page_size=1000").json()["results"]
    assert {receipt["customer"] for receipt in first} == {"globex"}
    assert all(receipt["event_id"].startswith("g-") for receipt in first)


@pytest.mark.both_databases
def test_each_receipt_carries_its_mu_its_parts_and_the_cost_model_version_that_priced_it(
    served_model, gpu_type, acme, make_key, key_client
):
    v1 = make_cost_model(served_model, gpu_type)
    gateway = gateway_client(make_key, key_client)
    ran = post_usage(gateway, "acme", count=3, input_tokens=1000, output_tokens=100)
    refused = post_usage(
        gateway, "acme", count=1, input_tokens=2000, output_tokens=0, outcome="refused"
    )
    _, plaintext = make_key(customer=acme)
    receipts = key_client(plaintext).get(USAGE).json()["results"]
    by_id = {receipt["event_id"]: receipt for receipt in receipts}
    assert set(by_id) == set(ran + refused)
    stored = {event.event_id: event for event in UsageEvent.objects.all()}
    for event_id in ran:
        receipt = by_id[event_id]
        # 1 s of replica time per 1000 input tokens, 20 ms per output token, 50 ms per request.
        assert receipt["mu"] == pytest.approx((1.0 + 2.0 + 0.05) * 100 / 60)
        assert receipt["mu"] == stored[event_id].mu
        # No admission record: billed as best-effort, and it says why.
        assert (receipt["admission_class"], receipt["verification"]) == (
            "best_effort",
            "unrecorded",
        )
        assert (receipt["guaranteed_mu"], receipt["best_effort_mu"]) == (0.0, receipt["mu"])
        assert (receipt["cost_model_id"], receipt["cost_model_version"]) == (v1.pk, v1.version)
        assert (receipt["model"], receipt["input_tokens"], receipt["output_tokens"]) == (
            "llama-8b",
            1000,
            100,
        )
    # A refused request used nothing; with no admission record and no estimate sent, what it
    # would have cost is unknown, and shown as such.
    assert (by_id[refused[0]]["mu"], by_id[refused[0]]["estimated_mu"]) == (0.0, None)
    assert by_id[refused[0]]["outcome"] == "refused"


@pytest.fixture
def two_models_of_receipts(served_model, gpu_type, acme, globex):
    """acme: 30 requests of llama-8b on 2026-11-01 (one a minute from 00:00, every third
    refused, every other guaranteed) and 5 of mistral-7b at 00:10; globex: 10 of llama-8b."""
    mistral = ServedModelFactory(name="mistral-7b", reference_gpu_type=gpu_type)
    llama_v1 = make_cost_model(served_model, gpu_type)
    mistral_v1 = make_cost_model(mistral, gpu_type)
    events = [
        {
            "event_id": f"acme-{n}",
            "customer_id": acme.pk,
            "served_model_id": served_model.pk,
            "cost_model_id": llama_v1.pk,
            "finished_at": START + timedelta(minutes=n),
            "outcome": "refused" if n % 3 == 0 else "completed",
            "admission_class": "guaranteed" if n % 2 == 0 else "best_effort",
            "mu": 0.0 if n % 3 == 0 else 2.0,
        }
        for n in range(30)
    ]
    events += [
        {"event_id": f"mistral-{n}", "customer_id": acme.pk, "served_model_id": mistral.pk,
         "cost_model_id": mistral_v1.pk, "finished_at": START + timedelta(minutes=10)}
        for n in range(5)
    ]  # fmt: skip
    events += [
        {"event_id": f"globex-{n}", "customer_id": globex.pk, "served_model_id": served_model.pk,
         "cost_model_id": llama_v1.pk, "finished_at": START + timedelta(minutes=n)}
        for n in range(10)
    ]  # fmt: skip
    store_events(events)


@pytest.mark.both_databases
@pytest.mark.usefixtures("two_models_of_receipts")
def test_receipts_are_filtered_by_model_time_range_outcome_and_class(owner_client):
    def ids(query: str) -> set[str]:
        response = owner_client.get(f"{USAGE}?{query}")
        assert response.status_code == 200, response.json()
        return {receipt["event_id"] for receipt in response.json()["results"]}

    assert ids("model=mistral-7b") == {f"mistral-{n}" for n in range(5)}
    # From inclusive, to exclusive, on finished_at.
    window = "model=llama-8b&from=2026-11-01T00:05:00Z&to=2026-11-01T00:08:00Z"
    assert ids(window) == {"acme-5", "acme-6", "acme-7"}
    assert ids(f"{window}&outcome=refused") == {"acme-6"}
    assert ids(
        "model=llama-8b&outcome=completed&admission_class=guaranteed&to=2026-11-01T00:09:00Z"
    ) == {"acme-2", "acme-4", "acme-8"}
    # A member of acme never sees globex's, whatever the filter.
    assert not any(event_id.startswith("globex") for event_id in ids("page_size=1000"))


@pytest.mark.both_databases
@pytest.mark.usefixtures("two_models_of_receipts")
def test_a_planner_reads_any_customer_and_a_customer_cannot_name_another(
    planner_client, owner_client, outsider_client
):
    everyone = planner_client.get(f"{USAGE}?page_size=1000").json()["results"]
    assert {receipt["customer"] for receipt in everyone} == {"acme", "globex"}
    globex = planner_client.get(f"{USAGE}?customer=globex&page_size=1000").json()["results"]
    assert {receipt["event_id"] for receipt in globex} == {f"globex-{n}" for n in range(10)}
    # acme's owner naming globex is told no such choice, as for a customer that does not exist.
    for slug in ("globex", "initech"):
        refused = owner_client.get(f"{USAGE}?customer={slug}")
        assert refused.status_code == 400
        assert list(refused.json()["error"]["fields"]) == ["customer"]
    # globex's owner sees only globex's, and the CSV likewise.
    mine = outsider_client.get(f"{USAGE}?page_size=1000").json()["results"]
    assert {receipt["customer"] for receipt in mine} == {"globex"}
    exported = outsider_client.get(f"{USAGE}/csv").getvalue().decode()
    rows = list(csv.DictReader(io.StringIO(exported)))
    assert {row["customer"] for row in rows} == {"globex"} and len(rows) == 10


@pytest.mark.both_databases
@pytest.mark.usefixtures("two_models_of_receipts")
def test_bad_filters_page_sizes_and_cursors_are_refused_naming_the_field(owner_client, anon):
    for query, field in (
        ("from=yesterday", "from"),
        ("to=2026-11-01T00:00:00-23:00", "to"),
        ("outcome=lost", "outcome"),
        ("admission_class=vip", "admission_class"),
        ("model=gpt-9", "model"),
        ("page_size=0", "page_size"),
        ("page_size=5000", "page_size"),
        ("page_size=many", "page_size"),
        ("cursor=not-a-cursor", "cursor"),
        # Well-formed base64 and JSON, but not a position in this list.
        ("cursor=eyJhZnRlciI6WzFdfQ", "cursor"),
        ("cursor=eyJhZnRlciI6WyI5OTk5LTEyLTMxVDIzOjU5OjU5LTAxOjAwIiwxXX0", "cursor"),
    ):
        for path in (USAGE, f"{USAGE}/csv"):
            if path.endswith("csv") and field in ("page_size", "cursor"):
                continue
            response = owner_client.get(f"{path}?{query}")
            assert response.status_code == 400, (path, query, response.content)
            assert list(response.json()["error"]["fields"]) == [field], query
    assert anon.get(USAGE).status_code == 401
    assert anon.get(f"{USAGE}/csv").status_code == 401


@pytest.mark.both_databases
@pytest.mark.usefixtures("two_models_of_receipts")
def test_next_and_previous_links_walk_the_same_pages_both_ways(owner_client):
    url = f"{USAGE}?model=llama-8b&page_size=7"
    pages, link = [], url
    while link:
        body = owner_client.get(link).json()
        pages.append(([r["event_id"] for r in body["results"]], body["previous"]))
        link = body["next"]
    assert [len(ids) for ids, _ in pages] == [7, 7, 7, 7, 2]
    assert [event_id for ids, _ in pages for event_id in ids] == [
        f"acme-{n}" for n in range(29, -1, -1)
    ]
    assert pages[0][1] is None
    # Back from the last page, one page at a time, to the first (which has no previous).
    for index in range(len(pages) - 1, 0, -1):
        body = owner_client.get(pages[index][1]).json()
        assert [r["event_id"] for r in body["results"]] == pages[index - 1][0]
    assert owner_client.get(pages[1][1]).json()["previous"] is None


@pytest.mark.both_databases
@pytest.mark.usefixtures("two_models_of_receipts")
def test_the_csv_holds_the_rows_of_the_list_with_the_same_filters(owner_client):
    query = "model=llama-8b&from=2026-11-01T00:03:00Z&outcome=completed"
    listed = owner_client.get(f"{USAGE}?{query}&page_size=1000").json()["results"]
    response = owner_client.get(f"{USAGE}/csv?{query}")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv"
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [row["event_id"] for row in rows] == [receipt["event_id"] for receipt in listed]
    assert len(rows) == 18  # minutes 3..29, less the refused every third
    for row, receipt in zip(rows, listed, strict=True):
        assert float(row["mu"]) == receipt["mu"]
        assert float(row["best_effort_mu"]) == receipt["best_effort_mu"]
        assert int(row["cost_model_version"]) == receipt["cost_model_version"]
        assert row["finished_at"].endswith("Z") and row["ttft_ms"] == ""


@pytest.mark.both_databases
def test_the_receipts_best_effort_mu_equals_the_invoices_best_effort_lines(
    served_model, gpu_type, acme, owner_client
):
    """Two rate cards in November (the price changes on the 16th) make two best-effort lines;
    the receipts of the month, summed, are what they bill."""
    for day, price in ((1, "2.00"), (16, "3.00")):
        rate_card_create(
            served_model=served_model,
            effective_from=datetime(2026, 11, day, tzinfo=UTC),
            reserved_price_per_mu_minute_hour=Decimal("0.10"),
            best_effort_price_per_1000_mu=Decimal(price),
        )
    Reservation.objects.create(
        customer=acme, served_model=served_model, mu_per_minute=10, starts_at=START,
        status="active",
    )  # fmt: skip
    cost_model = make_cost_model(served_model, gpu_type)
    classes = ("guaranteed", "best_effort", "none")
    store_events(
        [
            {
                "event_id": f"e-{n}",
                "customer_id": acme.pk,
                "served_model_id": served_model.pk,
                "cost_model_id": cost_model.pk,
                # Across the month and past its edges: some fall in October or December.
                "finished_at": START + timedelta(minutes=37 * n - 400),
                "admission_class": classes[n % 3],
                "outcome": "refused" if n % 11 == 0 else "completed",
                "mu": 0.0 if n % 11 == 0 else 0.5 + (n % 13) / 3,
            }
            for n in range(1200)
        ]
    )
    usage_rollup()
    invoice_generate(period="2026-11")
    invoice = Invoice.objects.get(customer=acme)
    lines = invoice.lines.filter(kind="best_effort")
    assert lines.count() == 2

    receipts = page_through(
        owner_client, f"{USAGE}?from=2026-11-01T00:00:00Z&to=2026-12-01T00:00:00Z", page_size=500
    )
    assert 1100 < len(receipts) < 1200
    billed_mu = sum(line.evidence["mu"] for line in lines)
    assert sum(r["best_effort_mu"] for r in receipts) == pytest.approx(billed_mu, rel=1e-12)
    assert sum(line.quantity for line in lines) * 1000 == pytest.approx(billed_mu, rel=1e-9)
    # Each line's MU are its card's half of the month.
    second_half = [r for r in receipts if r["finished_at"] >= "2026-11-16T00:00:00"]
    by_price = {str(line.unit_price): line.evidence["mu"] for line in lines}
    assert sum(r["best_effort_mu"] for r in second_half) == pytest.approx(by_price["3.000000"])
    # The parts of each receipt add up to its MU.
    assert all(r["guaranteed_mu"] + r["best_effort_mu"] == r["mu"] for r in receipts)

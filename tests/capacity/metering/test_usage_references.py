"""The usage table's references (customer, model, deployment, cost model) hold without
row-by-row foreign keys: the database refuses an event that references a missing row, and the
delete of a row events reference, also when the two race (migration capacity 0035)."""

import threading
import uuid
from datetime import timedelta

import psycopg
import pytest
from django.db import IntegrityError, close_old_connections, connection, transaction
from django.db.models import ProtectedError
from django.utils import timezone

from accounts.models import Customer
from accounts.services import customer_create
from capacity.metering.ingestion import COLUMNS, usage_ingest, usage_rows_insert
from capacity.models import Deployment, UsageEvent
from core.errors import ConflictError
from tests.support.factories import ServedModelFactory

both = pytest.mark.both_databases


def _event(customer: str, **overrides) -> dict:
    finished = timezone.now() - timedelta(minutes=2)
    return {
        "event_id": uuid.uuid4().hex,
        "customer": customer,
        "model": "llama-8b",
        "started_at": (finished - timedelta(seconds=3)).isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": 1000,
        "output_tokens": 100,
        "outcome": "completed",
        "admission_class": "best_effort",
    } | overrides


def _ingest(customer: str, **overrides):
    return usage_ingest(
        events=[_event(customer, **overrides)], customer=None, may_name_customer=True
    )


def _row_kwargs(**changes) -> dict:
    """The newest stored event's columns (a new event id), with `changes`."""
    event = UsageEvent.objects.order_by("-id").first()
    values = {
        f.attname: getattr(event, f.attname)
        for f in UsageEvent._meta.concrete_fields
        if f.attname != "id"
    }
    values.update(event_id=uuid.uuid4().hex, **changes)
    return values


def _stored_row(**changes) -> tuple:
    """The same as ingestion writes it (its COLUMNS)."""
    values = _row_kwargs(**changes)
    return tuple(values[name] for name in COLUMNS)


@both
@pytest.mark.django_db
@pytest.mark.parametrize(
    "column", ["customer_id", "served_model_id", "deployment_id", "cost_model_id"]
)
def test_an_event_that_references_a_missing_row_is_refused(column, acme, sellable):
    assert _ingest("acme", deployment="llama-8b-h100").accepted
    with pytest.raises(IntegrityError), transaction.atomic():
        UsageEvent.objects.create(**_row_kwargs(**{column: 999_999}))
    # Ingestion's own write (COPY on PostgreSQL, INSERT … ON CONFLICT on SQLite) too, in its
    # transaction: nothing of the batch is stored.
    before = UsageEvent.objects.count()
    good, bad = _stored_row(), _stored_row(**{column: 999_999})
    with pytest.raises((IntegrityError, psycopg.IntegrityError)) as refused:
        usage_rows_insert([good, bad])
    assert "999999" in str(refused.value) or "FOREIGN KEY" in str(refused.value)
    assert UsageEvent.objects.count() == before
    # A reference changed to a missing row is refused as well.
    stored = UsageEvent.objects.order_by("-id").first()
    with pytest.raises(IntegrityError), transaction.atomic():
        UsageEvent.objects.filter(pk=stored.pk).update(**{column: 999_999})


@both
@pytest.mark.django_db
def test_deleting_what_events_reference_through_the_orm(acme, sellable):
    assert _ingest("acme", deployment="llama-8b-h100").accepted
    with pytest.raises(ProtectedError):
        Customer.objects.get(pk=acme.pk).delete()
    with pytest.raises(ProtectedError):
        sellable.delete()
    # A deployment's events outlive it, naming no deployment (on_delete=SET_NULL).
    Deployment.objects.get(name="llama-8b-h100").delete()
    assert UsageEvent.objects.get().deployment_id is None


@pytest.mark.postgresql_only
@pytest.mark.django_db
@pytest.mark.parametrize("what", ["customer", "served_model", "deployment", "cost_model"])
def test_a_raw_delete_of_a_referenced_row_fails_at_commit(what, acme, sellable):
    assert _ingest("acme", deployment="llama-8b-h100").accepted
    event = UsageEvent.objects.get()
    model = UsageEvent._meta.get_field(what).related_model
    if what == "served_model":
        # The event's model is referenced by its deployment and cost model too, whose own
        # foreign keys would refuse the delete first: an event of a model nothing else names.
        lone = ServedModelFactory(name="lone-model")
        event = UsageEvent.objects.create(**_row_kwargs(served_model_id=lone.pk))
    refused = pytest.raises(IntegrityError, match="still referenced by usage events")
    with refused, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {model._meta.db_table} WHERE id = %s",  # noqa: S608
            [getattr(event, f"{what}_id")],
        )
        # What the commit would do: the check is deferred, as the foreign key's was.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    assert model.objects.filter(pk=getattr(event, f"{what}_id")).exists()


def _in_thread(target) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = target()
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcome["error"] = error
        finally:
            close_old_connections()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.postgresql_only
@pytest.mark.django_db(transaction=True)
def test_events_stored_while_their_customer_is_deleted_block_the_delete(sellable):
    """The events' transaction first: the customer's delete waits for it, then fails."""
    customer_create(name="Doomed", slug="doomed")
    stored, release = threading.Event(), threading.Event()

    def ingest():
        with transaction.atomic():
            result = _ingest("doomed")
            stored.set()
            release.wait(10)
        return result

    def delete():
        Customer.objects.filter(slug="doomed").delete()  # the ORM's PROTECT finds nothing yet

    ingesting, ingested = _in_thread(ingest)
    assert stored.wait(10)
    deleting, deleted = _in_thread(delete)
    deleting.join(1.0)
    assert deleting.is_alive(), "the delete did not wait for the events' transaction"
    release.set()
    ingesting.join(10)
    deleting.join(10)
    assert ingested["value"].accepted, ingested
    assert isinstance(deleted.get("error"), IntegrityError), deleted
    assert "still referenced by usage events" in str(deleted["error"])
    assert Customer.objects.filter(slug="doomed").exists()
    assert UsageEvent.objects.filter(customer__slug="doomed").count() == 1


@pytest.mark.postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_batch_stored_while_its_customer_is_deleted_is_refused_whole_with_a_409(sellable):
    """The delete first: the batch's write waits for it, finds the customer gone, and nothing
    of the batch is stored (no event without its customer), answered as a conflict to retry."""
    customer_create(name="Doomed", slug="doomed")
    deleted, release = threading.Event(), threading.Event()

    def delete():
        with transaction.atomic():
            Customer.objects.filter(slug="doomed").delete()
            deleted.set()
            release.wait(10)

    deleting, _ = _in_thread(delete)
    assert deleted.wait(10)
    # The batch's checks read the customer as it was (the delete is not committed yet).
    ingesting, ingested = _in_thread(lambda: _ingest("doomed"))
    ingesting.join(1.0)
    assert ingesting.is_alive(), "the batch's write did not wait for the delete"
    release.set()
    deleting.join(10)
    ingesting.join(10)
    assert isinstance(ingested.get("error"), ConflictError), ingested
    assert ingested["error"].status == 409
    assert not Customer.objects.filter(slug="doomed").exists()
    orphans = UsageEvent.objects.exclude(customer_id__in=Customer.objects.values("id"))
    assert not orphans.exists()

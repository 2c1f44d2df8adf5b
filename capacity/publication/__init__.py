"""Publication: what gateways need to decide a request locally, written to Redis
(docs/gateway-contract.md, issue 18).

Four documents, each written whole in one MULTI/EXEC: `gw:v1:keys`, `gw:v1:models`,
`gw:v1:entitlements` and `gw:v1:meta` (its `version` grows with every publication, so a gateway
re-reads the others when it moves). They are built from the database by `documents.py` and
written by `publish.py`, at the end of every allocation tick and after the commit of every
write that changes them (`publish_after_commit`). A Redis error never fails the caller: it is
logged and counted (`controlplane_gateway_publications{result="failed"}`), and the next tick
publishes again.

This module only holds the trigger, so that the rooms whose writes change the documents
(catalog, pricing, health, selling) can call it without importing what the documents are
built from (which imports them).
"""

from __future__ import annotations

from django.db import transaction


def publish_after_commit(reason: str) -> None:
    """Publish every document once the current transaction commits (at once outside one).
    Several calls in one transaction publish once."""
    connection = transaction.get_connection()
    # Django keeps the pending callbacks as (savepoint ids, callback, robust); a rolled-back
    # savepoint drops its own, so looking here never suppresses a publication that is needed.
    pending = getattr(connection, "run_on_commit", [])
    if connection.in_atomic_block and any(
        getattr(entry[1], "gateway_publication", False) for entry in pending
    ):
        return

    def run() -> None:
        _publish(reason)

    run.gateway_publication = True  # type: ignore[attr-defined]
    transaction.on_commit(run)


def _publish(reason: str) -> None:
    from capacity.publication.publish import publish_gateway_state

    publish_gateway_state(reason=reason)


def publish_keys_changed() -> None:
    """accounts' after-commit hook (accounts.hooks): a key was created or revoked."""
    _publish("keys changed")

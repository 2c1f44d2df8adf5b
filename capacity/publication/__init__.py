"""Publication: what gateways need to decide a request locally, written to Redis
(docs/gateway-contract.md, issue 18).

Four documents, each written whole in one MULTI/EXEC: `gw:v1:keys`, `gw:v1:models`,
`gw:v1:entitlements` and `gw:v1:meta` (its `version` grows with every publication, so a gateway
re-reads the others when it moves); in the same transaction, the request limits admission's
Lua script reads (`adm:rl:*`, capacity.admission.limits). They are built from the database
by `documents.py` (the request limits by capacity.admission.limits) and written by
`publish.py`, at the end of every allocation tick and after the commit of every write that
changes them (`publish_after_commit`). A Redis error never fails the caller: it is
logged and counted (`controlplane_gateway_publications{result="failed"}`), and the next tick
publishes again.

This module only holds the trigger, so that the rooms whose writes change the documents
(catalog, pricing, health, selling, admission) can call it without importing what the
documents are built from (which imports them).
"""

from __future__ import annotations

from django.db import transaction


def publish_after_commit(reason: str) -> None:
    """Publish every document once the current transaction commits (at once outside one).
    Each call publishes: a publication reads everything, so one more costs a few queries,
    and skipping one could lose the change that asked for it."""
    transaction.on_commit(lambda: _publish(reason))


def _publish(reason: str) -> None:
    from capacity.publication.publish import publish_gateway_state

    publish_gateway_state(reason=reason)


def publish_keys_changed() -> None:
    """accounts' after-commit hook (accounts.hooks): a key was created or revoked."""
    _publish("keys changed")

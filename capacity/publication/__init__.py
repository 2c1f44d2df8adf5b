"""Publication: what gateways need to decide a request locally, written to Redis
(docs/gateway-contract.md, issue 18).

The documents, each written whole in one MULTI/EXEC: `gw:v1:keys`, `gw:v1:models`,
`gw:v1:entitlements`, `gw:v1:customers`, `gw:v1:customer_tiers`, `gw:v1:reservations` and
`gw:v1:meta` (its `version` grows with every publication, so a gateway re-reads the others when
it moves); in the same transaction, the request limits admission's Lua script reads
(`adm:rl:*`, capacity.admission.limits) and the reservation floors it guarantees by
(`adm:floor:*`, capacity.admission.floors): those a sale changed, and all of them at least once
a minute. They are built from the database
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

from collections.abc import Collection


def publish_after_commit(
    reason: str, *, floors_of: Collection[tuple[int, int]] | None = None
) -> None:
    """Publish every document once the current transaction commits (at once outside one).
    Each call publishes: a publication reads everything, so one more costs a few queries,
    and skipping one could lose the change that asked for it. `floors_of`: the (customer id,
    model id)s whose reservation floors changed (a sale), written with it."""
    # Imported here: the package's pure module (signing.py) is what gateways import, and
    # importing it runs this file, which must not bring Django into a gateway.
    from django.db import transaction

    pairs = None if floors_of is None else list(floors_of)
    transaction.on_commit(lambda: _publish(reason, floors_of=pairs))


def _publish(reason: str, *, floors_of: Collection[tuple[int, int]] | None = None) -> None:
    from capacity.publication.publish import publish_gateway_state

    publish_gateway_state(reason=reason, floors_of=floors_of)


def publish_keys_changed() -> None:
    """accounts' after-commit hook (accounts.hooks): a key was created or revoked."""
    _publish("keys changed")

"""What capacity's lower floors announce to its upper ones, without importing them (the layers
in pyproject.toml; docs/architecture.md).

A sale, an entitlement, a degradation, a cost model or a probe changes what gateways must read,
yet the publication that writes it (capacity.publication) reads from all of those rooms and so
sits above them; a probe round that finds replicas newly ready wants a tick now, yet the tick
(capacity.allocation) reads the probes' results. So the upper rooms subscribe here at start-up
(`CapacityConfig.ready`), as capacity subscribes to accounts' key writes (accounts.hooks), and
the lower ones call the announcement where the change is made. Not a Django signal: services
say explicitly where they notify (docs/design.md#services: no logic in signals).

- `gateway_state_changed(reason, floors_of=...)`: inside the writing transaction; the
  subscribers (the publication) run after it commits, never for a rolled-back write.
- `tick_wanted(reason, debounce=...)`: at once; the subscriber (allocation's wake) queues a
  tick.
- `deployment_written(deployment, changes)` and `deployment_deleted(pk)`: inside the writing
  transaction, at once, and a subscriber's error fails the write: benchmarking, which sits
  above capacity, owns the deployment's suite and its nightly beat row
  (benchmarking.references) and writes them in the same transaction, so a rolled-back write
  leaves them as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from django.db import transaction

if TYPE_CHECKING:
    from capacity.models import Deployment

logger = logging.getLogger(__name__)


class GatewayStateSubscriber(Protocol):
    def __call__(
        self, reason: str, *, floors_of: Collection[tuple[int, int]] | None = None
    ) -> None: ...


class TickSubscriber(Protocol):
    def __call__(self, *, reason: str, debounce: bool = True) -> bool: ...


_gateway_state: list[GatewayStateSubscriber] = []
_tick: list[TickSubscriber] = []
_deployment_written: list[Callable[[Deployment, Mapping[str, Any]], None]] = []
_deployment_deleted: list[Callable[[int], None]] = []


def on_gateway_state_changed(callback: GatewayStateSubscriber) -> None:
    """Run `callback(reason, floors_of=...)` after every committed change gateways must see."""
    if callback not in _gateway_state:
        _gateway_state.append(callback)


def on_tick_wanted(callback: TickSubscriber) -> None:
    """Run `callback(reason=..., debounce=...)` whenever a room asks for a tick now."""
    if callback not in _tick:
        _tick.append(callback)


def gateway_state_changed(
    reason: str, *, floors_of: Collection[tuple[int, int]] | None = None
) -> None:
    """What gateways read changed: publish it once the current transaction commits (at once
    outside one). Each call publishes: a publication reads everything, so one more costs a few
    queries, and skipping one could lose the change that asked for it. `floors_of`: the
    (customer id, model id)s whose reservation floors changed (a sale), written with it."""
    pairs = None if floors_of is None else list(floors_of)
    transaction.on_commit(lambda: _announce_gateway_state(reason, pairs))


def tick_wanted(*, reason: str, debounce: bool = True) -> bool:
    """Ask for an allocation tick now; True when one was queued (capacity.allocation.wake says
    when it is not)."""
    queued = False
    for callback in list(_tick):
        try:
            queued = callback(reason=reason, debounce=debounce) or queued
        except Exception:  # asking for a tick never fails the round that asked
            logger.exception("capacity: a tick-wanted hook failed")
    return queued


def _announce_gateway_state(reason: str, floors_of: list[tuple[int, int]] | None) -> None:
    for callback in list(_gateway_state):
        try:
            callback(reason, floors_of=floors_of)
        except Exception:  # a subscriber's failure never fails the write that committed
            logger.exception("capacity: a gateway-state hook failed")


def on_deployment_written(callback: Callable[[Deployment, Mapping[str, Any]], None]) -> None:
    """Run `callback(deployment, changes)` inside every transaction that creates or changes a
    deployment (`changes`: the values written, by field name)."""
    if callback not in _deployment_written:
        _deployment_written.append(callback)


def on_deployment_deleted(callback: Callable[[int], None]) -> None:
    """Run `callback(deployment_pk)` inside every transaction that deletes a deployment."""
    if callback not in _deployment_deleted:
        _deployment_deleted.append(callback)


def deployment_written(deployment: Deployment, changes: Mapping[str, Any]) -> None:
    """A deployment was created or changed: the subscribers write what they own of it, in
    this transaction (their errors propagate: the write fails whole)."""
    for callback in list(_deployment_written):
        callback(deployment, changes)


def deployment_deleted(deployment_pk: int) -> None:
    """A deployment was deleted: the subscribers remove what they own of it, in this
    transaction."""
    for callback in list(_deployment_deleted):
        callback(deployment_pk)

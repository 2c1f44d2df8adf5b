"""After-commit hooks on accounts' writes, for the apps that depend on accounts.

accounts imports nothing above it (docs/architecture.md: the dependency order), yet capacity
must republish the gateways' copy of the keys the moment a key is created or revoked (a revoked
key is refused by gateways within seconds). So capacity registers a callback here at start-up
(`CapacityConfig.ready`), and accounts' services call `keys_changed()` inside their transaction:
the callbacks run after it commits, never for a rolled-back write. Not a Django signal: the
services say explicitly where they notify (docs/design.md#services: no logic in signals).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import transaction

logger = logging.getLogger(__name__)

_on_keys_changed: list[Callable[[], None]] = []


def on_keys_changed(callback: Callable[[], None]) -> None:
    """Run `callback()` after every committed change to API keys or their owners."""
    if callback not in _on_keys_changed:
        _on_keys_changed.append(callback)


def keys_changed() -> None:
    """Called by accounts' services inside the writing transaction."""
    transaction.on_commit(_run_keys_changed)


def _run_keys_changed() -> None:
    for callback in list(_on_keys_changed):
        try:
            callback()
        except Exception:  # a subscriber's failure never fails the write that committed
            logger.exception("accounts: a keys-changed hook failed")

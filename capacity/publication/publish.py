"""Write the gateway documents to Redis, whole, in one transaction (docs/gateway-contract.md).

Publishers are the allocation tick and after-commit hooks in web and worker processes, so two
may run at once. Each holds a short Redis lock from reading the database to writing Redis:
a publisher that read before a key was revoked can then never overwrite the publication made
after the revocation. Any failure is logged and counted, never raised: the callers are ticks
and writes that already committed, and the next tick publishes again.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from capacity.admission.floors import floors_digest
from capacity.admission.floors import floors_of as reservation_floors
from capacity.admission.gate import buckets
from capacity.admission.limits import published_request_limits
from capacity.admission.redis_layout import (
    FLOORS_DIGEST_KEY,
    FLOORS_FRESH_KEY,
    FLOORS_INDEX,
    FLOORS_REFRESH_SECONDS,
    REQUEST_LIMITS_INDEX,
    queue_floors,
    queue_request_limits,
)
from capacity.publication import signing
from capacity.publication.documents import (
    customer_documents,
    customer_tier_documents,
    entitlement_documents,
    key_documents,
    model_documents,
    reservation_documents,
)
from capacity.telemetry import metrics

logger = logging.getLogger(__name__)

KEYS = "gw:v1:keys"
MODELS = "gw:v1:models"
ENTITLEMENTS = "gw:v1:entitlements"
META = "gw:v1:meta"
CUSTOMERS = "gw:v1:customers"
CUSTOMER_TIERS = "gw:v1:customer_tiers"
RESERVATIONS = "gw:v1:reservations"
# json.dumps with separators builds an encoder per call: one, for the tens of thousands of
# fields (a customer's, its tier's) written every tick. The same text.
_to_json = json.JSONEncoder(separators=(",", ":")).encode

LOCK = "controlplane:gateway-publication"
LOCK_TIMEOUT_SECONDS = 30  # a crashed publisher's lock frees itself after this
LOCK_WAIT_SECONDS = 5.0


@functools.cache
def _parsed_signing_key(spec: str) -> tuple[str, Ed25519PrivateKey] | None:
    return signing.parse_private_key(spec)


def publication_signing_key() -> tuple[str, Ed25519PrivateKey] | None:
    """(id, key) of settings.PUBLICATION_SIGNING_KEY, None when unsigned; raises
    ImproperlyConfigured when it is malformed, or missing with DEBUG off (checked at start by
    capacity/apps.py, so a process never starts without it)."""
    try:
        parsed = _parsed_signing_key(settings.PUBLICATION_SIGNING_KEY)
    except signing.SigningKeyError as error:
        raise ImproperlyConfigured(f"PUBLICATION_SIGNING_KEY: {error}") from None
    if parsed is None and not settings.DEBUG and not settings.BUILD_STEP:
        raise ImproperlyConfigured(
            "PUBLICATION_SIGNING_KEY is required when DEBUG is off: without it, whoever can "
            "write to Redis can publish a gateway key. Make a pair with `manage.py "
            "publication_keys new`; the public half is the gateways' GATEWAY_PUBLICATION_KEYS."
        )
    return parsed


def publish_gateway_state(
    *, reason: str, floors_of: Collection[tuple[int, int]] | None = None
) -> int | None:
    """Publish every document, the request limits admission's script reads and the
    reservation floors it guarantees by (those of `floors_of`, the (customer id, model id)s a
    sale changed; all of them when the last whole write is over a minute old); the new
    `gw:v1:meta` version, or None if it failed."""
    try:
        client = buckets().client
        with client.lock(LOCK, timeout=LOCK_TIMEOUT_SECONDS, blocking_timeout=LOCK_WAIT_SECONDS):
            version = _publish_locked(client, floors_of)
    except redis.RedisError as error:
        metrics.GATEWAY_PUBLICATIONS.labels(result="failed").inc()
        logger.warning("publication (%s): Redis error, gateways keep their copy: %s", reason, error)
        return None
    except Exception:  # noqa: BLE001 - a committed write or a tick must never fail here
        metrics.GATEWAY_PUBLICATIONS.labels(result="failed").inc()
        logger.exception("publication (%s) failed", reason)
        return None
    metrics.GATEWAY_PUBLICATIONS.labels(result="ok").inc()
    logger.debug("publication (%s): version %s", reason, version)
    return version


@dataclass(frozen=True)
class _FloorsWrite:
    """Which reservation floors a publication writes: all of them (`whole`, replacing
    `previous`, the floors the last whole write left) or only those a sale names."""

    whole: bool
    digest: str
    previous: Collection[bytes]


def _publish_locked(client: redis.Redis, floors_of: Collection[tuple[int, int]] | None) -> int:
    """One publication, under the publishers' lock: read the database and what the indexes
    hold, then write everything in one transaction. Read under the lock: no other publisher
    writes the indexes until this one is done, and one that read the database before a sale
    never writes after the sale's own."""
    now = timezone.now()
    floors = reservation_floors(now=now)
    encoded = _encoded_documents(now, floors)
    request_limits = published_request_limits()
    previous_scopes = client.smembers(REQUEST_LIMITS_INDEX)
    floors_write = _floors_write(client, floors)
    pipe = client.pipeline(transaction=True)
    for key, fields in encoded.items():
        pipe.delete(key)
        if fields:
            pipe.hset(key, mapping=fields)
    queue_request_limits(pipe, request_limits, previous_scopes)
    _queue_floors_write(pipe, floors, floors_write, floors_of)
    meta = _meta(client)
    signing_key = publication_signing_key()
    if signing_key is not None:
        # Signed (capacity.publication.signing): a gateway holding the public key takes no
        # publication that a party other than the control plane wrote.
        key_id, private = signing_key
        meta["signature"] = signing.sign(key_id, private, signing.digest(encoded, meta))
    else:
        pipe.hdel(META, "signature")
    pipe.hset(META, mapping=meta)
    pipe.execute()
    return int(meta["version"])


def _encoded_documents(now: datetime, floors: Mapping) -> dict[str, dict[str, str]]:
    """Every document as the hashes gateways read: field -> JSON text."""
    documents = {
        KEYS: key_documents(now=now),
        MODELS: model_documents(now=now),
        ENTITLEMENTS: entitlement_documents(),
        CUSTOMERS: customer_documents(),
        CUSTOMER_TIERS: customer_tier_documents(),
        RESERVATIONS: reservation_documents(floors),
    }
    return {
        key: {name: _to_json(value) for name, value in fields.items()}
        for key, fields in documents.items()
    }


def _floors_write(client: redis.Redis, floors: Mapping) -> _FloorsWrite:
    """The floors whole when they differ from the last whole write (a reservation changed by
    any path, or a partial write since) or that is over a minute old (Redis lost them); else
    only those a sale names."""
    digest = floors_digest(floors)
    fresh, written = client.mget(FLOORS_FRESH_KEY, FLOORS_DIGEST_KEY)
    whole = fresh is None or written != digest.encode()
    return _FloorsWrite(
        whole=whole, digest=digest, previous=client.smembers(FLOORS_INDEX) if whole else ()
    )


def _queue_floors_write(
    pipe: Any,
    floors: Mapping,
    write: _FloorsWrite,
    floors_of: Collection[tuple[int, int]] | None,
) -> None:
    queue_floors(
        pipe,
        floors,
        idle_ttl_ms=int(settings.ADMISSION_LIMITS_TTL_SECONDS * 1000),
        pairs=None if write.whole else (floors_of or ()),
        previous=write.previous,
    )
    if write.whole:
        pipe.set(FLOORS_FRESH_KEY, "1", ex=FLOORS_REFRESH_SECONDS)
        pipe.set(FLOORS_DIGEST_KEY, write.digest)
    elif floors_of:
        pipe.delete(FLOORS_DIGEST_KEY)  # the next publication checks them whole


def _meta(client: redis.Redis) -> dict[str, str]:
    """gw:v1:meta: the admission parameters the buckets' Lua scripts take (a gateway uses the
    control plane's, so its decisions and the API's are the same rule with the same burst),
    when, and the next version: counted here, under the lock (no other publisher writes it
    meanwhile), and signed, so a gateway takes no publication older than its copy."""
    return {
        "admission_burst_seconds": repr(float(settings.ADMISSION_BURST_SECONDS)),
        "admission_limits_ttl_seconds": repr(float(settings.ADMISSION_LIMITS_TTL_SECONDS)),
        "admission_record_ttl_seconds": str(int(settings.ADMISSION_RECORD_TTL_SECONDS)),
        "admission_concurrency_ttl_seconds": str(int(settings.ADMISSION_CONCURRENCY_TTL_SECONDS)),
        "admission_best_effort_fresh_seconds": repr(float(settings.ADMISSION_TICK_STALE_SECONDS)),
        "admission_best_effort_stale_seconds": repr(
            float(settings.ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS)
        ),
        "published_at": repr(time.time()),
        "version": str(int(client.hget(META, "version") or 0) + 1),
    }


def publish_changed_state(
    reason: str, *, floors_of: Collection[tuple[int, int]] | None = None
) -> None:
    """capacity.hooks' subscriber: a committed write changed what gateways read."""
    publish_gateway_state(reason=reason, floors_of=floors_of)


def publish_keys_changed() -> None:
    """accounts' after-commit hook (accounts.hooks): a key was created or revoked."""
    publish_gateway_state(reason="keys changed")

"""The gateway contract as read from Redis (docs/gateway-contract.md): keys, models,
entitlements, customers and their tiers, reservation floors, and their version.

`ContractReader.refresh()` checks `gw:v1:meta.version` and re-reads the documents when it
changed; the last good copy is kept whenever Redis cannot be read or a document is malformed
(a bad entry is skipped, the rest used), and, with GATEWAY_PUBLICATION_KEYS, whenever the
publication is not signed by the control plane or is older than the copy held (a replay).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from redis.exceptions import RedisError

from capacity.admission.bucket import Floor
from capacity.publication.signing import digest, replayed_over, verify

from .metrics import PUBLICATIONS_REFUSED

log = logging.getLogger("dataplane.gateway")

KEYS = "gw:v1:keys"
MODELS = "gw:v1:models"
ENTITLEMENTS = "gw:v1:entitlements"
CUSTOMERS = "gw:v1:customers"
CUSTOMER_TIERS = "gw:v1:customer_tiers"
META = "gw:v1:meta"
RESERVATIONS = "gw:v1:reservations"
# Gateway workers' liveness: field the worker's owner id, value when it was last alive (ms);
# the control plane's reaper closes the requests of a worker gone for good.
WORKERS = "gw:v1:workers"
WAITING = "gw:v1:waiting"
SPOOL = "gw:v1:spool"
ADMISSION_PARAMETERS = (
    "admission_burst_seconds",
    "admission_limits_ttl_seconds",
    "admission_record_ttl_seconds",
    "admission_concurrency_ttl_seconds",
    "admission_best_effort_fresh_seconds",
    "admission_best_effort_stale_seconds",
)


@dataclass(frozen=True)
class ApiKey:
    prefix: str
    secret_sha256: str
    kind: str  # "customer" | "service"
    customer_id: int | None
    customer: str | None
    scopes: frozenset[str]
    expires_at: float | None
    revoked: bool


@dataclass(frozen=True)
class Degradation:
    level: int = 0
    refuse_best_effort: bool = False
    max_tokens_cap: int | None = None
    fallback_model: str | None = None
    # While only some tiers are shed, their names; None: `refuse_best_effort` applies to all.
    shed_tiers: frozenset[str] | None = None

    def refuses_best_effort_of(self, tier: str | None) -> bool:
        """Whether a best-effort request of a customer of `tier` is shed. A customer whose
        tier is not published is shed with the listed tiers: the safe side."""
        if not self.refuse_best_effort:
            return False
        if self.shed_tiers is None or tier is None:
            return True
        return tier in self.shed_tiers


@dataclass(frozen=True)
class Replica:
    endpoint: str
    deployment: str
    gpu_type: str
    priority_scheduling: bool


@dataclass(frozen=True)
class CostModel:
    weights_replica_seconds: Mapping[str, float]
    replica_mu_per_minute: float


@dataclass(frozen=True)
class Model:
    name: str
    model_id: int
    engine_model_id: str
    context_length_tokens: int
    cost_model: CostModel | None
    output_cap_tokens: int | None
    bytes_per_token: float
    degradation: Degradation
    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class Contract:
    version: int | None = None
    published_at: float | None = None
    keys: Mapping[str, ApiKey] = field(default_factory=dict)
    models: Mapping[str, Model] = field(default_factory=dict)
    entitlements: Mapping[int, frozenset[str]] = field(default_factory=dict)
    # slug -> customer id: gw:v1:customers, and the customer keys' own (a service key names the
    # customer it acts for by slug)
    customers: Mapping[str, int] = field(default_factory=dict)
    # The control plane's admission parameters (gw:v1:meta): burst, limits TTL, record TTL,
    # the TTL of a concurrency slot.
    admission: Mapping[str, float] = field(default_factory=dict)
    # customer id -> its tier's name (gw:v1:customer_tiers), for a degradation's `shed_tiers`
    customer_tiers: Mapping[int, str] = field(default_factory=dict)
    # customer id -> model name -> its reservation floor (gw:v1:reservations): what the
    # worker admits by, a share of it, while Redis cannot be reached
    reservations: Mapping[int, Mapping[str, Floor]] = field(default_factory=dict)
    read_at: float = 0.0

    @property
    def loaded(self) -> bool:
        return self.version is not None


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_key(prefix: str, raw: str) -> ApiKey:
    doc = json.loads(raw)
    return ApiKey(
        prefix=prefix,
        secret_sha256=str(doc["secret_sha256"]),
        kind=str(doc["kind"]),
        customer_id=_optional_int(doc.get("customer_id")),
        customer=doc.get("customer"),
        scopes=frozenset(str(s) for s in doc.get("scopes") or ()),
        expires_at=_optional_float(doc.get("expires_at")),
        revoked=bool(doc.get("revoked", False)),
    )


def parse_model(name: str, raw: str) -> Model:
    doc = json.loads(raw)
    cost = doc.get("cost_model")
    cost_model = (
        None
        if cost is None
        else CostModel(
            weights_replica_seconds={
                str(k): float(v) for k, v in cost["weights_replica_seconds"].items()
            },
            replica_mu_per_minute=float(cost["replica_mu_per_minute"]),
        )
    )
    deg = doc.get("degradation") or {}
    return Model(
        name=name,
        model_id=int(doc["model_id"]),
        engine_model_id=str(doc.get("engine_model_id") or name),
        context_length_tokens=int(doc["context_length_tokens"]),
        cost_model=cost_model,
        output_cap_tokens=_optional_int(doc.get("output_cap_tokens")),
        bytes_per_token=float(doc.get("bytes_per_token") or 4.0),
        degradation=Degradation(
            level=int(deg.get("level") or 0),
            refuse_best_effort=bool(deg.get("refuse_best_effort", False)),
            max_tokens_cap=_optional_int(deg.get("max_tokens_cap")),
            fallback_model=deg.get("fallback_model"),
            shed_tiers=(
                None
                if deg.get("shed_tiers") is None
                else frozenset(str(t) for t in deg["shed_tiers"])
            ),
        ),
        replicas=tuple(
            Replica(
                endpoint=str(r["endpoint"]).rstrip("/"),
                deployment=str(r.get("deployment") or ""),
                gpu_type=str(r.get("gpu_type") or ""),
                priority_scheduling=bool(r.get("priority_scheduling", False)),
            )
            for r in doc.get("replicas") or ()
        ),
    )


def build_contract(
    *,
    meta: Mapping[bytes | str, bytes | str],
    keys: Mapping[bytes | str, bytes | str],
    models: Mapping[bytes | str, bytes | str],
    entitlements: Mapping[bytes | str, bytes | str],
    customers: Mapping[bytes | str, bytes | str] | None = None,
    customer_tiers: Mapping[bytes | str, bytes | str] | None = None,
    reservations: Mapping[bytes | str, bytes | str] | None = None,
) -> Contract:
    """A contract from the hashes as Redis returns them; bad entries are skipped."""
    parsed_keys: dict[str, ApiKey] = {}
    customer_ids: dict[str, int] = {}
    for raw_prefix, raw in keys.items():
        prefix = _text(raw_prefix)
        try:
            key = parse_key(prefix, _text(raw))
        except (ValueError, KeyError, TypeError) as error:
            log.warning("gw:v1:keys %s: unreadable (%s); skipped", prefix, error)
            continue
        parsed_keys[prefix] = key
        if key.customer and key.customer_id is not None:
            customer_ids[key.customer] = key.customer_id
    parsed_models: dict[str, Model] = {}
    for raw_name, raw in models.items():
        name = _text(raw_name)
        try:
            parsed_models[name] = parse_model(name, _text(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("gw:v1:models %s: unreadable (%s); skipped", name, error)
    parsed_entitlements: dict[int, frozenset[str]] = {}
    for raw_customer, raw in entitlements.items():
        try:
            names = json.loads(_text(raw))
            parsed_entitlements[int(_text(raw_customer))] = frozenset(str(n) for n in names)
        except (ValueError, TypeError) as error:
            log.warning("gw:v1:entitlements %r: unreadable (%s); skipped", raw_customer, error)
    for raw_slug, raw_id in (customers or {}).items():
        try:
            customer_ids.setdefault(_text(raw_slug), int(_text(raw_id)))
        except ValueError:
            log.warning("gw:v1:customers %r: unreadable; skipped", raw_slug)
    tiers: dict[int, str] = {}
    for raw_customer, raw_tier in (customer_tiers or {}).items():
        try:
            tiers[int(_text(raw_customer))] = _text(raw_tier)
        except ValueError:
            log.warning("gw:v1:customer_tiers %r: unreadable; skipped", raw_customer)
    floors: dict[int, dict[str, Floor]] = {}
    for raw_customer, raw in (reservations or {}).items():
        try:
            floors[int(_text(raw_customer))] = {
                str(name): Floor(
                    mu_per_minute=float(doc["mu_per_minute"]),
                    steps=tuple((float(at), float(mu)) for at, mu in doc.get("steps") or ()),
                )
                for name, doc in json.loads(_text(raw)).items()
            }
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            log.warning("gw:v1:reservations %r: unreadable (%s); skipped", raw_customer, error)
    meta_text = {_text(k): _text(v) for k, v in meta.items()}
    admission: dict[str, float] = {}
    for name in ADMISSION_PARAMETERS:
        with contextlib.suppress(KeyError, ValueError):
            admission[name] = float(meta_text[name])
    return Contract(
        version=int(meta_text.get("version", "0")),
        published_at=_optional_float(meta_text.get("published_at")),
        keys=parsed_keys,
        models=parsed_models,
        entitlements=parsed_entitlements,
        customers=customer_ids,
        admission=admission,
        customer_tiers=tiers,
        reservations=floors,
        read_at=time.time(),
    )


class ContractReader:
    """Holds the current contract; `run()` refreshes it every `refresh_seconds`."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        refresh_seconds: float,
        publication_keys: Mapping[str, Ed25519PublicKey] | None = None,
        skew_seconds: float = 2.0,
    ):
        self.client = client
        self.refresh_seconds = refresh_seconds
        # Empty: publications are taken unsigned (a control plane without a signing key).
        self.publication_keys = dict(publication_keys or {})
        self.skew_seconds = skew_seconds
        self.contract = Contract()
        self._changed = asyncio.Event()
        self._refused_version: int | None = None  # not read again until the version moves

    async def refresh(self) -> bool:
        """Re-read when the version changed; True when a new copy was taken."""
        try:
            version = await self.client.hget(META, "version")  # type: ignore[misc]
            if version is None:
                return False
            if self.contract.loaded and int(version) == self.contract.version:
                return False
            if int(version) == self._refused_version:
                return False
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(META)
            pipe.hgetall(KEYS)
            pipe.hgetall(MODELS)
            pipe.hgetall(ENTITLEMENTS)
            pipe.hgetall(CUSTOMERS)
            pipe.hgetall(CUSTOMER_TIERS)
            pipe.hgetall(RESERVATIONS)
            meta, keys, models, entitlements, customers, tiers, reserved = await pipe.execute()
        except (RedisError, OSError, ValueError) as error:
            log.warning("the contract could not be read (%s); serving on the last copy", error)
            return False
        documents = {
            KEYS: keys,
            MODELS: models,
            ENTITLEMENTS: entitlements,
            CUSTOMERS: customers,
            CUSTOMER_TIERS: tiers,
            RESERVATIONS: reserved,
        }
        refusal = self.refusal(documents, meta)
        if refusal is not None:
            reason, detail = refusal
            PUBLICATIONS_REFUSED.labels(reason).inc()
            log.error(
                "publication version %s refused (%s); serving on the last copy", version, detail
            )
            self._refused_version = int(version)
            return False
        self.contract = build_contract(
            meta=meta,
            keys=keys,
            models=models,
            entitlements=entitlements,
            customers=customers,
            customer_tiers=tiers,
            reservations=reserved,
        )
        log.info("contract version %s read", self.contract.version)
        # Wake whoever waits for a change (requests held for a model at zero).
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    def refusal(
        self,
        documents: Mapping[str, Mapping[bytes | str, bytes | str]],
        meta: Mapping[bytes | str, bytes | str],
    ) -> tuple[str, str] | None:
        """Why a publication read from Redis is not taken, as (metric reason, log text); None
        when it is. Only with publication keys: a signature one of them verifies over the
        documents and meta as read, and a `published_at` not older than the copy held."""
        if not self.publication_keys:
            return None
        text = {_text(k): _text(v) for k, v in meta.items()}
        signature = text.get("signature")
        if not signature:
            return "unsigned", "it carries no signature"
        if not verify(self.publication_keys, signature, digest(documents, meta)):
            key_id = signature.partition(":")[0]
            known = "a key this gateway holds" if key_id in self.publication_keys else "no key"
            return "signature", f"its signature does not verify ({key_id!r} is {known})"
        try:
            published_at = float(text["published_at"])
            version = int(text["version"])
        except (KeyError, ValueError):
            return "signature", "it has no version or published_at"
        held = self.contract
        if (
            held.version is not None
            and held.published_at is not None
            and replayed_over(
                version=version,
                published_at=published_at,
                held_version=held.version,
                held_published_at=held.published_at,
                skew_seconds=self.skew_seconds,
            )
        ):
            return "replay", (
                f"version {version} published at {published_at:.3f} is not newer than the "
                f"copy held, version {held.version} published at {held.published_at:.3f}"
            )
        return None

    async def changed(self, timeout_seconds: float) -> None:
        """Wait for the next new copy, at most `timeout_seconds`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_seconds)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_seconds)

"""The control plane's side of docs/gateway-contract.md, as the tests write it.

ONE helper (`publish`) writes every document exactly as the contract specifies, so that it
can be swapped for the real publisher (capacity/publication/) once that exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis

from accounts.keys import mint
from tests.support.publication import write_signed

KEYS = "gw:v1:keys"
CUSTOMERS = "gw:v1:customers"
MODELS = "gw:v1:models"
ENTITLEMENTS = "gw:v1:entitlements"
CUSTOMER_TIERS = "gw:v1:customer_tiers"
RESERVATIONS = "gw:v1:reservations"
META = "gw:v1:meta"
WAITING = "gw:v1:waiting"
SPOOL = "gw:v1:spool"
WORKERS = "gw:v1:workers"

# The emulator's test model, priced so that one short request is well under 1 MU.
WEIGHTS = {"input_tokens": 1e-4, "output_tokens": 2e-3, "request": 1e-3}


@dataclass
class Key:
    plaintext: str
    prefix: str
    doc: dict


def key(
    *,
    customer_id: int | None = 1,
    customer: str | None = "acme",
    kind: str = "customer",
    scopes: tuple[str, ...] = ("read", "admission"),
    expires_at: float | None = None,
    revoked: bool = False,
) -> Key:
    minted = mint()
    doc = {
        "secret_sha256": minted.secret_sha256,
        "kind": kind,
        "customer_id": customer_id if kind == "customer" else None,
        "customer": customer if kind == "customer" else None,
        "scopes": list(scopes),
        "expires_at": expires_at,
        "revoked": revoked,
    }
    return Key(plaintext=minted.plaintext, prefix=minted.prefix, doc=doc)


def replica(endpoint: str, *, deployment: str = "dep", priority_scheduling: bool = False) -> dict:
    return {
        "endpoint": endpoint,
        "deployment": deployment,
        "gpu_type": "h100",
        "priority_scheduling": priority_scheduling,
    }


def model(
    model_id: int,
    replicas: list[dict],
    *,
    engine_model_id: str = "tiny",
    context_length_tokens: int = 2048,
    weights: dict | None = None,
    output_cap_tokens: int | None = None,
    bytes_per_token: float = 4.0,
    refuse_best_effort: bool = False,
    max_tokens_cap: int | None = None,
    fallback_model: str | None = None,
    level: int = 0,
    shed_tiers: list[str] | None = None,
) -> dict:
    return {
        "model_id": model_id,
        "engine_model_id": engine_model_id,
        "context_length_tokens": context_length_tokens,
        "cost_model": {
            "weights_replica_seconds": weights or WEIGHTS,
            "replica_mu_per_minute": 100.0,
        },
        "output_cap_tokens": output_cap_tokens,
        "bytes_per_token": bytes_per_token,
        "degradation": {
            "level": level,
            "refuse_best_effort": refuse_best_effort,
            "max_tokens_cap": max_tokens_cap,
            "fallback_model": fallback_model,
            "shed_tiers": shed_tiers,
        },
        "replicas": replicas,
    }


@dataclass
class Publication:
    keys: dict[str, dict] = field(default_factory=dict)  # prefix -> doc
    models: dict[str, dict] = field(default_factory=dict)  # name -> doc
    entitlements: dict[int, list[str]] = field(default_factory=dict)
    customer_tiers: dict[int, str] = field(default_factory=dict)  # customer id -> tier name
    # customer id -> model name -> reserved MU/min (a floor with no later step)
    reservations: dict[int, dict[str, float]] = field(default_factory=dict)


def publish(client: redis.Redis, publication: Publication) -> int:
    """Write the documents whole, signed as the control plane signs them, with the next
    `gw:v1:meta.version`; returns the version (tests/support/publication.py)."""
    return write_signed(
        client,
        {
            KEYS: {p: json.dumps(d) for p, d in publication.keys.items()},
            MODELS: {n: json.dumps(d) for n, d in publication.models.items()},
            ENTITLEMENTS: {str(c): json.dumps(n) for c, n in publication.entitlements.items()},
            CUSTOMERS: {},
            CUSTOMER_TIERS: {str(c): tier for c, tier in publication.customer_tiers.items()},
            RESERVATIONS: {
                str(c): json.dumps(
                    {name: {"mu_per_minute": mu, "steps": []} for name, mu in floors.items()}
                )
                for c, floors in publication.reservations.items()
            },
        },
    )


def clear(client: redis.Redis) -> None:
    stale = [*client.scan_iter(match="gw:v1:*", count=1000)]
    stale += [*client.scan_iter(match="adm:*", count=1000)]
    if stale:
        client.delete(*stale)

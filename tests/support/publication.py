"""Publications written as the control plane writes them (docs/gateway-contract.md), for tests
and benchmarks that drive a gateway without running the control plane's publisher: whole,
signed with PUBLICATION_SIGNING_KEY (scripts/test.sh and bench.sh set a test-only pair, whose
public half every gateway they start holds), with the next version."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import redis

from capacity.publication import signing

META = "gw:v1:meta"
DOCUMENTS = (
    "gw:v1:keys",
    "gw:v1:models",
    "gw:v1:entitlements",
    "gw:v1:customers",
    "gw:v1:customer_tiers",
    "gw:v1:reservations",
)


def write_signed(client: redis.Redis, documents: Mapping[str, Mapping[str, str]]) -> int:
    """Replace the named documents whole (the others stay as they are), sign the set and
    return the new `gw:v1:meta.version`. The meta fields a real publication left (its admission
    parameters) stay, and are signed with the rest."""
    current = {name: _text_fields(client.hgetall(name)) for name in DOCUMENTS}
    current.update({name: dict(fields) for name, fields in documents.items()})
    meta: dict[bytes | str, bytes | str] = {
        k: v
        for k, v in _text_fields(client.hgetall(META)).items()
        if k not in ("version", "signature", "published_at")
    }
    meta["published_at"] = repr(time.time())
    meta["version"] = str(int(client.hget(META, "version") or 0) + 1)
    pipe = client.pipeline(transaction=True)
    pipe.delete(*documents)
    for name, fields in documents.items():
        if fields:
            pipe.hset(name, mapping=dict(fields))
    key = signing.parse_private_key(os.environ.get("PUBLICATION_SIGNING_KEY", ""))
    if key is None:
        pipe.hdel(META, "signature")
    else:
        meta["signature"] = signing.sign(key[0], key[1], signing.digest(current, meta))
    pipe.hset(META, mapping=meta)
    pipe.execute()
    return int(meta["version"])


def _text_fields(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }

"""The gateway contract's signature (docs/gateway-contract.md, "Signed publications"). Pure: no
Django, no Redis; the control plane signs with it, gateways verify with it.

Redis write access must not be a way around the control plane (issue 34, finding 9: an
`HSET gw:v1:keys` forged a gateway key that got 200). Every publication is signed with
Ed25519 over a digest of every document's every field and the meta fields a gateway acts on,
in one canonical order, with the moment of the publication (`published_at`). The control plane
holds the private key; gateways hold only public keys, so not even a gateway's own host can
forge a publication. A gateway that holds keys takes a copy only when its signature verifies
under one of them, and only when it is newer than the copy it holds (`replayed_over`: an old,
validly signed publication replayed would bring back a revoked key).

A key has an id and the signature names it (`<id>:<base64>`). Rotation: gateways are given the
new public key beside the old one (two valid), the control plane switches to the new private
key, and the old public key is dropped once no gateway holds a copy signed with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# The one gw:v1:meta field not signed: the signature. The version and `published_at` are, so
# that a gateway can tell an old publication replayed from a new one (replayed_over).
UNSIGNED_META_FIELDS = frozenset({"signature"})
_RAW_KEY_BYTES = 32


class SigningKeyError(ValueError):
    """A key spec is malformed; the message says how."""


def _items(spec: str) -> list[tuple[str, bytes]]:
    items: list[tuple[str, bytes]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key_id, colon, encoded = item.partition(":")
        if not colon or not key_id or not key_id.isascii() or not key_id.replace("-", "").isalnum():
            raise SigningKeyError("each key is '<id>:<base64>', the id letters, digits or '-'")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except binascii.Error:
            raise SigningKeyError(f"key '{key_id}' is not base64") from None
        if len(raw) != _RAW_KEY_BYTES:
            raise SigningKeyError(f"key '{key_id}' is not a 32-byte Ed25519 key")
        if any(key_id == seen for seen, _ in items):
            raise SigningKeyError(f"key id '{key_id}' is given twice")
        items.append((key_id, raw))
    return items


def parse_private_key(spec: str) -> tuple[str, Ed25519PrivateKey] | None:
    """ "id:<base64 of the 32-byte private key>" -> (id, key); "" -> None (unsigned)."""
    items = _items(spec)
    if len(items) > 1:
        raise SigningKeyError("the control plane signs with one key")
    if not items:
        return None
    key_id, raw = items[0]
    return key_id, Ed25519PrivateKey.from_private_bytes(raw)


def parse_public_keys(spec: str) -> dict[str, Ed25519PublicKey]:
    """ "id:<base64 public key>[,id:<base64 public key>]" -> {id: key}; two during a rotation."""
    return {key_id: Ed25519PublicKey.from_public_bytes(raw) for key_id, raw in _items(spec)}


def generate(key_id: str) -> tuple[str, str]:
    """A new key pair as (private spec for the control plane, public spec for gateways)."""
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    private_raw = private.private_bytes_raw()
    return (
        f"{key_id}:{base64.b64encode(private_raw).decode()}",
        f"{key_id}:{base64.b64encode(public).decode()}",
    )


def public_spec(spec: str) -> str:
    """The public spec that verifies what the private `spec` signs."""
    parsed = parse_private_key(spec)
    if parsed is None:
        return ""
    key_id, private = parsed
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return f"{key_id}:{base64.b64encode(public).decode()}"


def _text(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def digest(
    documents: Mapping[str, Mapping[bytes | str, bytes | str]],
    meta: Mapping[bytes | str, bytes | str],
) -> bytes:
    """SHA-256 of every document's fields and the signed meta fields, in a canonical order
    (sorted, each part length-prefixed so no two publications share a digest)."""
    parts: list[tuple[bytes, bytes, bytes]] = []
    for name, fields in documents.items():
        parts.extend((name.encode(), _text(k), _text(v)) for k, v in fields.items())
    parts.extend(
        (b"gw:v1:meta", _text(k), _text(v))
        for k, v in meta.items()
        if (k.decode() if isinstance(k, bytes) else k) not in UNSIGNED_META_FIELDS
    )
    hasher = hashlib.sha256()
    for part in sorted(parts):
        for piece in part:
            hasher.update(b"%d:" % len(piece))
            hasher.update(piece)
    return hasher.digest()


def replayed_over(
    *,
    version: int,
    published_at: float,
    held_version: int,
    held_published_at: float,
    skew_seconds: float,
) -> bool:
    """Whether a signed publication is not newer than the copy held, so a replay. Newer is a
    higher version published no earlier than the copy held (within the publishers' clock
    skew), or, after the versions started again (Redis lost its data), one published clearly
    later. Either way a publication older than the copy held by more than the skew is a replay,
    whatever its version (one captured before a Redis restart carries a higher one)."""
    if published_at < held_published_at - skew_seconds:
        return True
    return version <= held_version and published_at <= held_published_at + skew_seconds


def sign(key_id: str, private: Ed25519PrivateKey, content_digest: bytes) -> str:
    """The signature (`<id>:<base64>`) of a publication's digest under the private key."""
    return f"{key_id}:{base64.b64encode(private.sign(content_digest)).decode()}"


def verify(keys: Mapping[str, Ed25519PublicKey], signature: str, content_digest: bytes) -> bool:
    """Whether `signature` is one of `keys`' over `content_digest`."""
    key_id, _, encoded = signature.partition(":")
    public = keys.get(key_id)
    if public is None:
        return False
    try:
        public.verify(base64.b64decode(encoded, validate=True), content_digest)
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True

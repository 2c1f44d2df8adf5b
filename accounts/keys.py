"""Minting and checking API key secrets.

The secret is 256 random bits, so a single fast SHA-256 is enough to keep it safe at rest
(there is no dictionary to attack, unlike a password), and checking a key costs microseconds
on every request rather than the hundreds of milliseconds a password hasher would.
"""

import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX_BYTES = 6  # 12 hex characters: unique enough to index, short enough to show in lists
SECRET_BYTES = 32


@dataclass(frozen=True)
class MintedKey:
    prefix: str
    secret: str
    secret_sha256: str

    @property
    def plaintext(self) -> str:
        return f"{self.prefix}.{self.secret}"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def mint() -> MintedKey:
    prefix = "mu" + secrets.token_hex(PREFIX_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return MintedKey(prefix=prefix, secret=secret, secret_sha256=hash_secret(secret))


def split(plaintext: str) -> tuple[str, str] | None:
    prefix, dot, secret = plaintext.strip().partition(".")
    if not dot or not prefix or not secret:
        return None
    return prefix, secret


def secret_matches(secret: str, secret_sha256: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), secret_sha256)

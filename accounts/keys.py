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
    """A new key's parts: the prefix (stored, shown), the secret (never stored) and its hash."""

    prefix: str
    secret: str
    secret_sha256: str

    @property
    def plaintext(self) -> str:
        """What the caller is given once: `prefix.secret`."""
        return f"{self.prefix}.{self.secret}"


def hash_secret(secret: str) -> str:
    """The stored form of a secret: its SHA-256, in hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def mint() -> MintedKey:
    """A fresh key, from the `secrets` module: `mu` and 12 random hex characters as its
    prefix, 256 random bits as its secret."""
    prefix = "mu" + secrets.token_hex(PREFIX_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return MintedKey(prefix=prefix, secret=secret, secret_sha256=hash_secret(secret))


def split(plaintext: str) -> tuple[str, str] | None:
    """(prefix, secret) of a presented key; None when it is not of that shape."""
    prefix, dot, secret = plaintext.strip().partition(".")
    if not dot or not prefix or not secret:
        return None
    return prefix, secret


def secret_matches(secret: str, secret_sha256: str) -> bool:
    """Whether a presented secret is the stored one, compared in constant time."""
    return hmac.compare_digest(hash_secret(secret), secret_sha256)

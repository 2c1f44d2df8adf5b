"""The gateway's settings: every one a `GATEWAY_*` environment variable (dataplane/README.md).

A malformed value fails loudly at start, naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from capacity.publication.signing import SigningKeyError, parse_public_keys

from .http import Limits


class SettingsError(ValueError):
    """A `GATEWAY_*` variable is malformed; the message names it."""


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 2
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_seconds: float = 0.25
    refresh_seconds: float = 1.0
    control_plane_url: str = ""
    service_key: str = ""
    usage_batch_max: int = 5000
    usage_flush_seconds: float = 1.0
    usage_timeout_seconds: float = 10.0
    spool_retry_seconds: float = 5.0
    max_body_bytes: int = 10 * 1024 * 1024
    # A completion's list of prompts (each one engine request) and `n` (sequences per prompt):
    # at most this many, each counted as the work it is.
    max_prompts: int = 64
    max_n: int = 16
    # What slow, half-sent or too many connections may hold (dataplane/gateway/http.py): 0
    # turns one off.
    header_timeout_seconds: float = 10.0
    body_grace_seconds: float = 5.0
    body_min_bytes_per_second: float = 16 * 1024.0
    max_connections: int = 4096
    max_connections_per_client: int = 512
    max_body_bytes_in_flight: int = 256 * 1024 * 1024
    token_timeout_seconds: float = 30.0
    request_timeout_seconds: float = 600.0
    connect_timeout_seconds: float = 2.0
    retries: int = 2
    retry_backoff_seconds: float = 0.05
    cold_start_wait_seconds: float = 90.0
    # On SIGTERM a worker stops accepting and gives the requests in flight this long to end
    # (a rollout should not cut a long stream); then the unsent usage goes to web or the spool.
    shutdown_grace_seconds: float = 60.0
    session_header: str = "X-Session-Id"
    prefix_affinity_bytes: int = 0
    affinity_load_factor: float = 1.5
    customer_header: str = "X-MU-Customer"
    admission_burst_seconds: float = 10.0
    admission_limits_ttl_seconds: float = 600.0
    admission_record_ttl_seconds: int = 72 * 3600 + 3600
    admission_concurrency_ttl_seconds: float = 600.0
    # While Redis cannot be reached: "guaranteed" admits each customer up to this worker's
    # share of its reservation floor (the contract's gw:v1:reservations) from a bucket in the
    # worker and refuses best-effort; "refuse" refuses everything. Nothing admits without
    # bound (there is no "admit").
    on_redis_down: str = "guaranteed"
    # How many gateway workers share a reservation while Redis is down: each admits
    # 1/fallback_processes of it. 0: this gateway's own workers (one gateway). Set it to the
    # workers of all gateways in front of the fleet, so that together they admit at most the
    # reservation.
    fallback_processes: int = 0
    retry_after_seconds: int = 60
    # The control plane's publication keys, "<id>:<base64 Ed25519 public key>[,...]" (two
    # during a rotation; `manage.py publication_keys`): a publication none of them signed is
    # refused and the last good copy kept. Empty: publications are taken unsigned (a warning
    # at start), as from a control plane without PUBLICATION_SIGNING_KEY.
    publication_keys: str = ""
    # How much older than the copy held a publication may be (publishers' clocks differ by
    # this much at most); an older one is a replay and refused.
    publication_skew_seconds: float = 2.0
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            name = "GATEWAY_" + field.name.upper()
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            values[field.name] = _parse(name, raw, type(getattr(cls, field.name)))
        settings = cls(**values)  # type: ignore[arg-type]
        settings.check()
        return settings

    def check(self) -> None:
        positive = (
            "workers",
            "refresh_seconds",
            "usage_batch_max",
            "usage_flush_seconds",
            "max_body_bytes",
            "token_timeout_seconds",
            "request_timeout_seconds",
            "redis_timeout_seconds",
            "connect_timeout_seconds",
            "affinity_load_factor",
            "max_prompts",
            "max_n",
            "admission_burst_seconds",
            "admission_concurrency_ttl_seconds",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise SettingsError(f"GATEWAY_{name.upper()} must be > 0")
        for name in (
            "retries",
            "retry_backoff_seconds",
            "cold_start_wait_seconds",
            "shutdown_grace_seconds",
            "header_timeout_seconds",
            "body_grace_seconds",
            "body_min_bytes_per_second",
            "max_connections",
            "max_connections_per_client",
            "max_body_bytes_in_flight",
        ):
            if getattr(self, name) < 0:
                raise SettingsError(f"GATEWAY_{name.upper()} must be >= 0")
        if self.usage_batch_max > 5000:
            raise SettingsError("GATEWAY_USAGE_BATCH_MAX must be at most 5000 (the API's limit)")
        if self.on_redis_down not in ("guaranteed", "refuse"):
            removed = (
                " (admit, which admitted everything without a bucket, a limit or a record "
                "while Redis was down, was removed)"
                if self.on_redis_down == "admit"
                else ""
            )
            raise SettingsError(f"GATEWAY_ON_REDIS_DOWN must be guaranteed or refuse{removed}")
        if self.fallback_processes < 0:
            raise SettingsError("GATEWAY_FALLBACK_PROCESSES must be >= 0")
        if self.publication_skew_seconds < 0:
            raise SettingsError("GATEWAY_PUBLICATION_SKEW_SECONDS must be >= 0")
        try:
            self.publication_public_keys  # noqa: B018 (parsed to check it)
        except SigningKeyError as error:
            raise SettingsError(f"GATEWAY_PUBLICATION_KEYS: {error}") from None

    @property
    def publication_public_keys(self) -> dict[str, Ed25519PublicKey]:
        return parse_public_keys(self.publication_keys)

    @property
    def limits(self) -> Limits:
        return Limits(
            header_timeout_seconds=self.header_timeout_seconds,
            body_grace_seconds=self.body_grace_seconds,
            body_min_bytes_per_second=self.body_min_bytes_per_second,
            max_connections=self.max_connections,
            max_connections_per_client=self.max_connections_per_client,
            max_body_bytes_in_flight=self.max_body_bytes_in_flight,
        )

    @property
    def fallback_share(self) -> float:
        """The share of a reservation one worker admits while Redis is down."""
        return 1.0 / (self.fallback_processes or self.workers)


def _parse(name: str, raw: str, kind: type) -> object:
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a {kind.__name__}") from None
    return raw.strip()

"""Typed readers for environment variables.

Every setting comes from the environment (docs/design.md#settings). A malformed value must
stop start-up with a message that names the variable, so each reader raises
ImproperlyConfigured with it.
"""

import os
from typing import overload
from urllib.parse import urlparse

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from core.bounds import ascii_whole_number

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


@overload
def env_str(name: str, default: str) -> str: ...
@overload
def env_str(name: str, default: None = None) -> str | None: ...
def env_str(name: str, default: str | None = None) -> str | None:
    """The variable's text, stripped; `default` when unset or empty."""
    value = _raw(name)
    return default if value is None or value == "" else value


def env_bool(name: str, default: bool) -> bool:
    """1/0, true/false, yes/no or on/off (empty is false); anything else stops start-up."""
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={value!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off."
    )


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """A whole number, at least `minimum` when given; `default` when unset or empty."""
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer.") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}.")
    return number


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """A number (never NaN), at least `minimum` when given; `default` when unset or empty."""
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number.") from None
    if number != number or (minimum is not None and number < minimum):
        raise ImproperlyConfigured(f"{name}={number} must be at least {minimum}.")
    return number


def env_optional_int(name: str, default: int | None) -> int | None:
    """An integer, or None when set to "none" (e.g. to leave a request field out)."""
    value = _raw(name)
    if value is None or value == "":
        return default
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer or 'none'.") from None


def env_list(name: str, default: list[str]) -> list[str]:
    """A comma-separated list; empty items are dropped."""
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_database(name: str, default_url: str) -> dj_database_url.DBConfig:
    """Django's DATABASES entry for a database URL (persistent connections, health-checked)."""
    url = env_str(name, default_url)
    try:
        config = dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    except Exception as error:  # dj-database-url raises several types for bad URLs
        raise ImproperlyConfigured(f"{name} is not a usable database URL: {error}") from None
    if not config.get("ENGINE"):
        raise ImproperlyConfigured(f"{name} has an unknown database scheme: {url!r}.")
    return config


def env_redis_url(name: str, default_url: str) -> str:
    """A redis://, rediss:// or unix:// URL, checked for a host and a well-formed port here,
    at start-up, rather than at the first connection."""
    url = env_str(name, default_url)
    parsed = urlparse(url)
    if parsed.scheme not in {"redis", "rediss", "unix"}:
        raise ImproperlyConfigured(
            f"{name}={url!r} is not a Redis URL: expected redis://, rediss:// or unix://."
        )
    if parsed.scheme != "unix" and not parsed.hostname:
        raise ImproperlyConfigured(f"{name}={url!r} has no host.")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ImproperlyConfigured(f"{name}={url!r} has a malformed port.") from None
    return url


def env_origins(name: str) -> list[str]:
    """A comma-separated list of http(s) origins (such as CSRF_TRUSTED_ORIGINS)."""
    origins = env_list(name, [])
    for origin in origins:
        parsed = urlparse(origin)
        if parsed.scheme not in {"http", "https"} or not parsed.netloc:
            raise ImproperlyConfigured(
                f"{name} holds {origin!r}, which is not an origin like https://cp.example.com."
            )
    return origins


def env_parsed(name: str, default, parse):
    """`parse(raw text)`, or `default` when unset; a ValueError becomes ImproperlyConfigured
    naming the variable."""
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        return parse(value)
    except ValueError as error:
        raise ImproperlyConfigured(f"{name}: {error}") from None


_RATE_PERIODS = {"s", "sec", "second", "m", "min", "minute", "h", "hour", "d", "day"}


def env_rate(name: str, default: str | None) -> str | None:
    """A DRF throttle rate, "N/min" (s, min, hour, day); "none" or empty: no limit (None)."""
    value = _raw(name)
    if value is None:
        value = default or ""
    if value.lower() in {"", "none", "off"}:
        return None
    count, _, period = value.partition("/")
    number = ascii_whole_number(count)
    if number is None or number < 1 or period.lower() not in _RATE_PERIODS:
        raise ImproperlyConfigured(
            f"{name}={value!r} is not a rate: use N/s, N/min, N/hour or N/day (N at least 1), "
            "or none."
        )
    return f"{number}/{period.lower()}"

"""Binding actuator secrets to the tests' local servers, as an operator binds them to theirs
(ACTUATOR_SECRET_DESTINATIONS, core/outbound.py)."""

import httpx


def origin(url: str) -> str:
    """scheme://host:port of `url`: a secret is bound to a host and port, never to a path."""
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.netloc.decode()}"


def bind_secret(settings, name: str, kind: str, *urls: str) -> None:
    """Bind the secret `name` to the origins of `urls` as a destination of `kind` ("supervisor"
    or "webhook"), keeping the bindings already set (settings: pytest-django's fixture)."""
    settings.ACTUATOR_SECRET_DESTINATIONS = {
        **settings.ACTUATOR_SECRET_DESTINATIONS,
        name: {kind: [origin(url) for url in urls]},
    }

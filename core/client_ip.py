"""The client's address, as the trusted proxies in front of the control plane saw it.

Each proxy appends the address it received the request from to X-Forwarded-For, so with N
trusted proxies the chain is `[whatever the client wrote..., client, proxy 1, ..., proxy N-1]`
and REMOTE_ADDR is proxy N. The client is the entry N places from the right of
`X-Forwarded-For + [REMOTE_ADDR]`; anything further left was written by the client itself and
is never trusted. With no trusted proxy (TRUSTED_PROXY_COUNT=0) it is REMOTE_ADDR.
"""

import ipaddress

from django.conf import settings


def _address(value: str) -> str | None:
    value = value.strip()
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def client_ip(request) -> str | None:
    """The client's address, normalised; None when there is none to read."""
    remote = request.META.get("REMOTE_ADDR") or ""
    proxies = settings.TRUSTED_PROXY_COUNT
    if proxies <= 0:
        return _address(remote) or remote or None
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    chain = [hop for hop in (part.strip() for part in forwarded.split(",")) if hop]
    chain.append(remote)
    # Fewer hops than trusted proxies: the request did not come through all of them; the
    # leftmost hop is the best there is.
    index = max(0, len(chain) - 1 - proxies)
    return _address(chain[index]) or _address(remote) or remote or None

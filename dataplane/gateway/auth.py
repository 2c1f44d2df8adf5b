"""Who is calling: the key checked locally against the published hash, and the customer the
request is for (docs/gateway-contract.md, `gw:v1:keys`)."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from .contract import ApiKey, Contract
from .errors import GatewayError

ADMISSION_SCOPE = "admission"
SERVICE = "service"
CUSTOMER = "customer"


@dataclass(frozen=True)
class Caller:
    key: ApiKey
    customer_id: int
    customer: str  # slug, named in the usage event

    @property
    def is_service(self) -> bool:
        return self.key.kind == SERVICE


def _unauthorized(message: str, code: str = "invalid_api_key") -> GatewayError:
    return GatewayError(401, message, code=code)


def authenticate(
    contract: Contract,
    authorization: str | None,
    named_customer: str | None,
    *,
    require_customer: bool = True,
) -> Caller:
    """The caller of `Authorization: Bearer prefix.secret`; `named_customer` is the customer
    header (a service key must name one; a customer key may name only its own)."""
    if not authorization:
        raise _unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
            code="missing_api_key",
        )
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("Send the API key as 'Authorization: Bearer KEY'.")
    prefix, dot, secret = token.strip().partition(".")
    key = contract.keys.get(prefix) if dot and secret else None
    digest = hashlib.sha256(secret.encode()).hexdigest()
    if key is None or not hmac.compare_digest(digest, key.secret_sha256):
        raise _unauthorized("Incorrect API key provided.")
    if key.revoked:
        raise _unauthorized("This API key has been revoked.", code="revoked_api_key")
    if key.expires_at is not None and key.expires_at <= time.time():
        raise _unauthorized("This API key has expired.", code="expired_api_key")
    if key.kind == SERVICE:
        if not named_customer and not require_customer:
            return Caller(key=key, customer_id=0, customer="")
        # A platform key sends traffic only with the scope that says so: a `read` key of a
        # dashboard is no gateway key for every customer.
        _require_admission(key)
        if not named_customer:
            raise GatewayError(
                400,
                "A service key must name the customer the request is for "
                "(the customer header, see GATEWAY_CUSTOMER_HEADER).",
                code="customer_required",
            )
        customer_id = contract.customers.get(named_customer)
        if customer_id is None:
            raise GatewayError(
                403, f"No customer '{named_customer[:64]}' is known.", code="unknown_customer"
            )
        return Caller(key=key, customer_id=customer_id, customer=named_customer)
    if key.kind != CUSTOMER or key.customer_id is None or not key.customer:
        raise _unauthorized("This API key cannot call the gateway.")
    _require_admission(key)
    if named_customer and named_customer != key.customer:
        raise GatewayError(
            403, "A customer key cannot send requests for another customer.", code="not_permitted"
        )
    return Caller(key=key, customer_id=key.customer_id, customer=key.customer)


def _require_admission(key: ApiKey) -> None:
    if ADMISSION_SCOPE not in key.scopes:
        raise GatewayError(
            403,
            f"This API key lacks the '{ADMISSION_SCOPE}' scope needed to send requests.",
            code="insufficient_scope",
        )


def may_use(contract: Contract, caller: Caller, model: str) -> bool:
    """The customer's entitlements, whoever sends for it (a service key acting for a customer
    uses only what that customer may). A service key naming no customer (listing models):
    every model."""
    if caller.is_service and not caller.customer:
        return True
    return model in contract.entitlements.get(caller.customer_id, frozenset())

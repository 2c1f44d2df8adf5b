"""Webhook: POST the target to a URL that scales the deployment however it likes.

The request is `POST <url>` with the JSON body

    {"deployment": ..., "model": ..., "target_replicas": N, "current_replicas": N,
     "decision_id": ... or null, "reasons": [...]}

and, signed with the secret in the environment variable `secret_env` names, three headers:

    X-Timestamp: <unix seconds>
    X-Webhook-Id: <32 hex digits, unique per request>
    X-Signature-256: sha256=<hex HMAC-SHA256(secret, f"{timestamp}.{webhook_id}." + raw body)>

The timestamp and the id are inside the signed material, so a captured request can be replayed
neither later nor now: a receiver recomputes the HMAC over the raw body it received (before
parsing it), compares with `hmac.compare_digest`, refuses a timestamp more than 5 minutes from
its own clock, and refuses an id it has already accepted within those 5 minutes (so it keeps
the ids it accepted for as long as their timestamps would pass). A config without `secret_env`
is refused unless the operator allows unsigned webhooks (ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS);
only then does a request go out without these headers.

The URL must be allowed by OUTBOUND_ALLOWED_HOSTS, at write time and again on the address the
connection is made to; redirects are not followed (a 3xx is a permanent failure). The secret
signs only for the host ACTUATOR_SECRET_DESTINATIONS binds it to, checked again before it is
read.

Any 2xx is success; if its body is a JSON object with an integer `observed_replicas`, that is
what the data plane reports running. 408, 409, 429, 5xx and network errors are worth retrying;
every other answer is not (a 401 means the secrets differ, a redirect a wrong URL).
"""

import hashlib
import hmac
import json
import time
import uuid

import httpx

from capacity.actuation.base import (
    Actuator,
    PermanentActuatorError,
    ScaleRequest,
    TransientActuatorError,
)
from capacity.actuation.config import validate_actuator_config
from core import outbound
from core.errors import DomainError

SIGNATURE_HEADER = "X-Signature-256"
TIMESTAMP_HEADER = "X-Timestamp"
WEBHOOK_ID_HEADER = "X-Webhook-Id"
_TRANSIENT_STATUSES = frozenset({408, 409, 429})
_MAX_ERROR_BODY_CHARS = 200


def sign(secret: str, timestamp: str, webhook_id: str, body: bytes) -> str:
    """The `X-Signature-256` value for a body sent at `timestamp` (unix seconds, as sent)
    with the unique id `webhook_id`."""
    message = f"{timestamp}.{webhook_id}.".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256)
    return f"sha256={digest.hexdigest()}"


def signed_headers(secret: str, body: bytes) -> dict[str, str]:
    """The three signature headers for `body`, with a fresh id and the current time."""
    timestamp = str(int(time.time()))
    webhook_id = uuid.uuid4().hex
    return {
        TIMESTAMP_HEADER: timestamp,
        WEBHOOK_ID_HEADER: webhook_id,
        SIGNATURE_HEADER: sign(secret, timestamp, webhook_id, body),
    }


def request_body(request: ScaleRequest) -> bytes:
    return json.dumps(
        {
            "deployment": request.deployment,
            "model": request.model,
            "target_replicas": request.target_replicas,
            "current_replicas": request.current_replicas,
            "decision_id": request.decision_id,
            "reasons": request.reasons,
        },
        separators=(",", ":"),
    ).encode()


class WebhookActuator(Actuator):
    kind = "webhook"

    def apply(self, request: ScaleRequest) -> int | None:
        settings = _settings(request.config)
        body = request_body(request)
        headers = {"Content-Type": "application/json"}
        secret_env = settings.get("secret_env")
        url = settings["url"]
        if secret_env:
            try:
                secret = outbound.actuator_secret(secret_env, kind=outbound.WEBHOOK, url=url)
            except outbound.SecretRefused as error:
                raise PermanentActuatorError(f"actuator_config.secret_env: {error}") from error
            if not secret:
                raise PermanentActuatorError(
                    f"environment variable {secret_env} (secret_env) is not set; "
                    "refusing to send an unsigned webhook."
                )
            headers |= signed_headers(secret, body)
        try:
            with outbound.client(timeout=settings["timeout_seconds"]) as client:
                response = client.post(url, content=body, headers=headers)
        except outbound.OutboundRefused as error:
            # The allow-list will refuse the next try too.
            raise PermanentActuatorError(f"{url}: {error}") from error
        except httpx.UnsupportedProtocol as error:
            raise PermanentActuatorError(f"{url}: {error}") from error
        except httpx.TransportError as error:
            # Timeouts, refused and reset connections: the receiver may be back next try.
            raise TransientActuatorError(f"{url}: {type(error).__name__}: {error}") from error
        except httpx.RequestError as error:
            # Redirect loops, undecodable content: the same request will fail the same way.
            raise PermanentActuatorError(f"{url}: {type(error).__name__}: {error}") from error
        status = response.status_code
        if 200 <= status < 300:
            return _observed_replicas(response)
        message = f"{url} answered {status}: {response.text[:_MAX_ERROR_BODY_CHARS]}"
        if status in _TRANSIENT_STATUSES or status >= 500:
            raise TransientActuatorError(message)
        raise PermanentActuatorError(message)


def _settings(config: dict) -> dict:
    # Re-checked at apply time: a row edited in the database must fail with the field's name.
    try:
        return validate_actuator_config(WebhookActuator.kind, config, check_hosts=False)
    except DomainError as error:
        raise PermanentActuatorError(str(error)) from error


def _observed_replicas(response: httpx.Response) -> int | None:
    try:
        parsed = response.json()
    except ValueError:
        return None  # a receiver need not answer JSON
    replicas = parsed.get("observed_replicas") if isinstance(parsed, dict) else None
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        return replicas
    return None

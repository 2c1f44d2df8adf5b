"""The `process` actuator: engine processes on a GPU host without Kubernetes.

The processes outlive any allocation tick, so they belong to the host agent
(`python -m dataplane.supervisor`) on that host; this actuator only tells the supervisor the
target.
It sends the deployment's parameters (engine name, host, ports, drain time) with every call,
so the supervisor keeps no database and a supervisor restarted empty is brought back to the
target by the next tick. It never sends a command: the supervisor runs only the engines of its
own allow-list. The supervisor's URL must be allowed by OUTBOUND_ALLOWED_HOSTS, and its token
bound to that supervisor by ACTUATOR_SECRET_DESTINATIONS (checked again here, before it is read).
"""

import httpx

from capacity.actuation.base import (
    Actuator,
    PermanentActuatorError,
    ScaleRequest,
    TransientActuatorError,
)
from capacity.actuation.config import validate_actuator_config
from capacity.models import ActuatorKind
from core import outbound
from core.errors import DomainError

# 408 and 429 say "later", 409 "someone else wrote first": all worth another try (base.py).
_RETRYABLE_CLIENT_ERRORS = {408, 409, 429}


class ProcessActuator(Actuator):
    kind = ActuatorKind.PROCESS

    def __init__(self, *, timeout_seconds: float = 10.0) -> None:
        self.timeout_seconds = timeout_seconds

    def apply(self, request: ScaleRequest) -> int | None:
        """POST the target to the supervisor; return how many replicas it reports ready."""
        try:
            # Also fills in defaults a config stored before a field existed lacks.
            config = validate_actuator_config(self.kind, request.config, check_hosts=False)
        except DomainError as error:
            raise PermanentActuatorError(str(error)) from error
        headers = {}
        url = config["supervisor_url"].rstrip("/") + "/scale"
        if config.get("token_env"):
            try:
                token = outbound.actuator_secret(
                    config["token_env"], kind=outbound.SUPERVISOR, url=url
                )
            except outbound.SecretRefused as error:
                raise PermanentActuatorError(f"actuator_config.token_env: {error}") from error
            if not token:
                raise PermanentActuatorError(
                    f"The environment variable {config['token_env']} (actuator_config.token_env) "
                    "is not set, so the process supervisor's token is unknown."
                )
            headers["Authorization"] = f"Bearer {token}"
        body = {
            "deployment": request.deployment,
            "replicas": request.target_replicas,
            "engine": config["engine"],
            "host": config["host"],
            "base_port": config["base_port"],
            "drain_seconds": config["drain_seconds"],
        }
        try:
            with outbound.client(timeout=self.timeout_seconds) as client:
                response = client.post(url, json=body, headers=headers)
        except outbound.OutboundRefused as error:
            raise PermanentActuatorError(f"process supervisor at {url}: {error}") from error
        except httpx.HTTPError as error:
            raise TransientActuatorError(
                f"process supervisor at {url}: {type(error).__name__}: {error}"
            ) from error
        if response.status_code >= 500 or response.status_code in _RETRYABLE_CLIENT_ERRORS:
            raise TransientActuatorError(_describe(url, response))
        if response.status_code >= 400:
            raise PermanentActuatorError(_describe(url, response))
        try:
            ready = response.json()["ready"]
        except (ValueError, KeyError, TypeError) as error:
            raise PermanentActuatorError(
                f"{url} answered {response.status_code} without a ready count; "
                "is supervisor_url a process supervisor?"
            ) from error
        if not isinstance(ready, int) or isinstance(ready, bool):
            raise PermanentActuatorError(f"{url} answered a ready count that is not an integer.")
        return ready


def _describe(url: str, response: httpx.Response) -> str:
    try:
        reason = str(response.json().get("error", ""))
    except (ValueError, AttributeError):
        reason = response.text[:200]
    answered = f"process supervisor at {url} answered {response.status_code}"
    return f"{answered}: {reason}" if reason else answered

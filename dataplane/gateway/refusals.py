"""What a refused request is told: which limit turned it away, whose, and when to come back.

A 503 `model_not_ready` for a request held through the whole cold-start wait; else a 429 that
names the limit that bit beside OpenAI's fields (`limit`: "mu", "rpm", "tpm", "concurrency" or
"budget"; `limit_scope`: "customer" or "api_key"), with a Retry-After from the decision.
"""

from __future__ import annotations

import math

from .contract import Model
from .errors import GatewayError
from .settings import Settings
from .usage import Usage

_REQUEST_LIMITS = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "concurrency": "requests in flight",
}


def model_not_ready(model: Model, settings: Settings) -> GatewayError:
    """No ready replica within the cold-start wait: the model is being started."""
    return GatewayError(
        503,
        f"The model '{model.name}' has no ready replica; it is being started. Retry shortly.",
        code="model_not_ready",
        headers={"Retry-After": str(max(1, int(settings.cold_start_wait_seconds)))},
    )


def refusal(usage: Usage, model: Model, settings: Settings) -> GatewayError:
    """The answer to a request admission refused (`usage` holds what its decision said)."""
    if usage.extra.get("not_ready"):
        # Held for the whole cold-start wait and still no replica: turned away as
        # demand (a refused event with its estimate), not as a rate limit.
        return model_not_ready(model, settings)
    wait_ms = float(usage.extra.get("retry_after_ms", -1))
    seconds = max(1, math.ceil(wait_ms / 1000.0)) if wait_ms >= 0 else settings.retry_after_seconds
    limit = usage.extra.get("limit")
    whose = "this API key's" if usage.extra.get("limit_scope") == "api_key" else "your"
    if limit == "budget":
        # The budget of the customer (adm:rl:c:<customer> field `budget`) or of this key
        # (adm:rl:k:<prefix>) is spent and its hard cap refuses best-effort; the
        # reservation still admits.
        error = GatewayError(
            429,
            f"Budget reached: {whose} monthly budget is spent and its hard cap refuses "
            "requests beyond your reservation.",
            code="budget_exceeded",
            headers={"Retry-After": str(seconds)},
        )
    elif limit in _REQUEST_LIMITS:
        error = GatewayError(
            429,
            f"Rate limit reached: over {whose} limit of {_REQUEST_LIMITS[limit]}. "
            + (f"Retry after {seconds} s." if wait_ms >= 0 else "This request never fits."),
            code=f"{limit}_limit_exceeded",
            headers={"Retry-After": str(seconds)},
        )
    else:
        error = GatewayError(
            429,
            f"Rate limit reached for the model '{model.name}': over the reservation and "
            f"the best-effort allowance. Retry after {seconds} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(seconds)},
        )
    # Which limit bit, beside OpenAI's fields, and whose.
    error.extra = {"limit": limit or "mu", "limit_scope": usage.extra.get("limit_scope")}
    return error

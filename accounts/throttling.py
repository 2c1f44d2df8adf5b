"""API throttles: per API key (or signed-in user), counted in the shared Redis cache.

`WriteThrottle` (every view's default) counts writes against API_THROTTLE_WRITES;
`UsageThrottle` counts usage batches against API_THROTTLE_USAGE. Reads are never counted. Rates
are read from settings on every request, so "none" turns a limit off without a code change.
A throttled request gets 429, `Retry-After` and the API's error body (controlplane.api.errors).
"""

from django.conf import settings
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import SimpleRateThrottle

from accounts.models import ApiKey


class _PerCallerThrottle(SimpleRateThrottle):
    setting_name = ""

    def get_rate(self):
        return getattr(settings, self.setting_name)

    def applies_to(self, method: str) -> bool:
        return method.upper() not in SAFE_METHODS

    def allow_request(self, request, view):
        if not self.applies_to(request.method):
            return True
        # The rate may have changed since this instance was made (settings are read per request).
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        return super().allow_request(request, view)

    def get_cache_key(self, request, view):
        auth = getattr(request, "auth", None)
        if isinstance(auth, ApiKey):
            ident = f"key:{auth.pk}"
        elif getattr(request.user, "is_authenticated", False) and request.user.pk is not None:
            ident = f"user:{request.user.pk}"
        else:
            return None  # anonymous callers are refused before they write anything
        return f"throttle:{self.scope}:{ident}"


class WriteThrottle(_PerCallerThrottle):
    scope = "writes"
    setting_name = "API_THROTTLE_WRITES"


class UsageThrottle(_PerCallerThrottle):
    scope = "usage"
    setting_name = "API_THROTTLE_USAGE"


def _throttled_response() -> dict:
    return {
        "description": "Too many requests from this key (or user) in the current window: "
        "retry after `Retry-After` seconds (API_THROTTLE_WRITES, API_THROTTLE_USAGE).",
        "headers": {
            "Retry-After": {
                "description": "Seconds to wait before the next request.",
                "schema": {"type": "integer"},
            }
        },
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "status": {"type": "integer", "enum": [429]},
                                "code": {"type": "string", "enum": ["throttled"]},
                                "message": {"type": "string"},
                                "details": {
                                    "type": "object",
                                    "properties": {"retry_after_seconds": {"type": "integer"}},
                                },
                            },
                            "required": ["status", "code", "message"],
                        }
                    },
                    "required": ["error"],
                }
            }
        },
    }


def document_throttled_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook: a 429 on every operation a throttle counts."""
    for path, _regex, method, view in generator._get_paths_and_endpoints():
        throttles = view.get_throttles()
        if not any(isinstance(t, _PerCallerThrottle) and t.applies_to(method) for t in throttles):
            continue
        operation = result.get("paths", {}).get(path, {}).get(method.lower())
        if operation is not None:
            operation.setdefault("responses", {}).setdefault("429", _throttled_response())
    return result

"""API throttles: per API key (or signed-in user), counted in the shared Redis cache.

`WriteThrottle` counts writes against API_THROTTLE_WRITES, `ReadThrottle` reads against
API_THROTTLE_READS (both every view's default); `ExportThrottle` counts, besides, the reads of
views whose `throttle_scope` is EXPORTS (core.api.throttle_scopes: an invoice's PDF or
CSV, the usage CSV, the schema) against the tighter API_THROTTLE_EXPORTS; `UsageThrottle`
counts usage batches against API_THROTTLE_USAGE. Rates are read from settings on every
request, so "none" turns a limit off without a code change. A throttled request gets 429,
`Retry-After` and the API's error body (core.api.errors).

An anonymous caller reaches a throttle only on the views open to anyone (the schema and its
docs page; every other view refuses it first, 401): it is counted by its client address, as
the trusted proxies saw it (core.client_ip).
"""

import functools
import math
from collections.abc import Callable
from typing import Concatenate, ParamSpec

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import SimpleRateThrottle

from accounts.models import ApiKey
from core.api.throttle_scopes import EXPORTS
from core.client_ip import client_ip


class _PerCallerThrottle(SimpleRateThrottle):
    setting_name = ""

    def get_rate(self):
        return getattr(settings, self.setting_name)

    def applies_to(self, method: str, view) -> bool:
        return method.upper() not in SAFE_METHODS

    def allow_request(self, request, view):
        if not self.applies_to(request.method, view):
            return True
        return self.count(request, view)

    def count(self, request, view) -> bool:
        """Count the request against this limit: False when it is over."""
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
        elif address := client_ip(request):
            ident = f"address:{address}"
        else:
            return None
        return f"throttle:{self.scope}:{ident}"


class WriteThrottle(_PerCallerThrottle):
    scope = "writes"
    setting_name = "API_THROTTLE_WRITES"


class ReadThrottle(_PerCallerThrottle):
    scope = "reads"
    setting_name = "API_THROTTLE_READS"

    def applies_to(self, method: str, view) -> bool:
        return method.upper() in SAFE_METHODS


class ExportThrottle(_PerCallerThrottle):
    scope = EXPORTS
    setting_name = "API_THROTTLE_EXPORTS"

    def applies_to(self, method: str, view) -> bool:
        return method.upper() in SAFE_METHODS and getattr(view, "throttle_scope", None) == EXPORTS


class UsageThrottle(_PerCallerThrottle):
    scope = "usage"
    setting_name = "API_THROTTLE_USAGE"


_P = ParamSpec("_P")


def counted_as_export(
    view_func: Callable[Concatenate[HttpRequest, _P], HttpResponse],
) -> Callable[Concatenate[HttpRequest, _P], HttpResponse]:
    """For a Django view that builds a document (the portal's invoice downloads): the same
    count per user as the API's exports, so a signed-in user cannot get around
    API_THROTTLE_EXPORTS by downloading through the page instead of the API."""

    @functools.wraps(view_func)
    def wrapper(request: HttpRequest, *args: _P.args, **kwargs: _P.kwargs) -> HttpResponse:
        throttle = ExportThrottle()
        if throttle.count(request, None):
            return view_func(request, *args, **kwargs)
        retry_after_seconds = max(1, math.ceil(throttle.wait() or 1))
        refused = HttpResponse(
            f"Too many downloads: retry in {retry_after_seconds} s.\n",
            status=429,
            content_type="text/plain",
        )
        refused["Retry-After"] = str(retry_after_seconds)
        return refused

    return wrapper


def _throttled_response(setting_names: list[str]) -> dict:
    return {
        "description": "Too many requests from this caller (its API key, user, or address) in "
        "the current window: "
        f"retry after `Retry-After` seconds ({', '.join(setting_names)}).",
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
        counted_by = [
            throttle.setting_name
            for throttle in view.get_throttles()
            if isinstance(throttle, _PerCallerThrottle) and throttle.applies_to(method, view)
        ]
        if not counted_by:
            continue
        operation = result.get("paths", {}).get(path, {}).get(method.lower())
        if operation is not None:
            operation.setdefault("responses", {}).setdefault("429", _throttled_response(counted_by))
    return result

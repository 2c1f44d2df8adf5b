"""One error body shape for every API response that is not a success.

    {"error": {"status": 400, "code": "invalid", "message": "...",
               "fields": {"max_replicas": ["must be at least min_replicas (3)."]},
               "details": {...}}}

`fields` maps a field path (dotted for nested objects, e.g. `actuator_config.namespace`, with
list indexes, e.g. `events.3.model`) to its reasons.
"""

import logging

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError
from django.db.models import ProtectedError
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from core.errors import DomainError

logger = logging.getLogger(__name__)


def error_body(
    *,
    status_code: int,
    code: str,
    message: str,
    fields: dict | None = None,
    details: dict | None = None,
) -> dict:
    body = {"status": status_code, "code": code, "message": message}
    if fields:
        body["fields"] = fields
    if details:
        body["details"] = details
    return {"error": body}


def _flatten(detail, prefix: str = "") -> dict[str, list[str]]:
    """DRF nests errors like its data; callers want one flat map of field path → reasons."""
    flat: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            path = key if not prefix else f"{prefix}.{key}"
            if key == "non_field_errors":
                path = prefix or "non_field_errors"
            for sub_path, reasons in _flatten(value, path).items():
                flat.setdefault(sub_path, []).extend(reasons)
    elif isinstance(detail, list):
        if detail and all(not isinstance(item, dict | list) for item in detail):
            flat[prefix or "non_field_errors"] = [str(item) for item in detail]
        else:
            for index, item in enumerate(detail):
                if not item:
                    continue
                path = f"{prefix}.{index}" if prefix else str(index)
                for sub_path, reasons in _flatten(item, path).items():
                    flat.setdefault(sub_path, []).extend(reasons)
    else:
        flat[prefix or "non_field_errors"] = [str(detail)]
    return flat


def _summary(fields: dict[str, list[str]]) -> str:
    parts = [f"{name}: {reasons[0]}" for name, reasons in list(fields.items())[:3]]
    more = len(fields) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _describe(obj) -> str:
    """`str(obj)`, or its model and id when that fails: a row deleted at the same moment can
    take a relation its `__str__` reads with it, and the error handler must never raise."""
    try:
        return str(obj)
    except Exception:
        meta = getattr(obj, "_meta", None)
        kind = str(meta.verbose_name) if meta is not None else type(obj).__name__
        return f"{kind} {getattr(obj, 'pk', None)}"


def api_exception_handler(exc, context):
    """DRF's EXCEPTION_HANDLER: every error in the one body shape (the module docstring).

    Ours and the database's are answered here (`_answered_directly`); Django's own become
    DRF's (`_as_drf_exception`), which DRF answers and `_error_body_of` rewords."""
    response = _answered_directly(exc)
    if response is not None:
        return response
    exc = _as_drf_exception(exc)
    response = exception_handler(exc, context)
    if response is None:
        return None
    response.data = _error_body_of(exc, response.status_code)
    return response


def _answered_directly(exc) -> Response | None:
    """The errors DRF does not know: a service's DomainError, a body too large, and what the
    database refused (a row still in use, a value it cannot hold, a constraint)."""
    if isinstance(exc, DomainError):
        return Response(
            error_body(
                status_code=exc.status,
                code=exc.code,
                message=exc.message,
                fields=exc.fields,
                details=exc.details,
            ),
            status=exc.status,
        )
    if isinstance(exc, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Response(
            error_body(
                status_code=413,
                code="body_too_large",
                message=f"The request body exceeds {limit // (1024 * 1024)} MiB; send less "
                "per request (usage: at most 5,000 events per batch).",
                details={"max_body_bytes": limit},
            ),
            status=413,
        )
    # Before IntegrityError: a ProtectedError is one.
    if isinstance(exc, ProtectedError):
        blockers = sorted({_describe(obj) for obj in exc.protected_objects})[:10]
        return Response(
            error_body(
                status_code=409,
                code="in_use",
                message="Still in use by: " + ", ".join(blockers) + ". Remove those first.",
                details={"in_use_by": blockers},
            ),
            status=409,
        )
    if isinstance(exc, DataError):
        # A value the database cannot hold (too long, out of range, NUL) got past validation:
        # still the caller's input, not a server fault. Every input is bounded at the edge
        # (core.bounds), so this is the net under a bound someone forgot.
        logger.warning("Input the database refused reached it unbounded: %s", exc)
        return Response(
            error_body(
                status_code=400,
                code="out_of_range",
                message="A value is out of the range the database stores; nothing was written.",
            ),
            status=400,
        )
    if isinstance(exc, IntegrityError):
        # A constraint caught what validation missed (e.g. a race on a unique name):
        # the state conflicts with the request; nothing was written.
        return Response(
            error_body(
                status_code=409,
                code="conflict",
                message="The request conflicts with existing data: "
                + (str(exc).splitlines() or ["a constraint refused it."])[0],
            ),
            status=409,
        )
    return None


def _as_drf_exception(exc):
    """Django's validation error, 404 and permission denied as DRF's, which it answers."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else exc.messages
        return exceptions.ValidationError(detail)
    if isinstance(exc, Http404):
        return exceptions.NotFound()
    if isinstance(exc, DjangoPermissionDenied):
        return exceptions.PermissionDenied()
    return exc


def _error_body_of(exc, status_code: int) -> dict:
    """The body of an error DRF answered: its fields flattened, its code and message."""
    if isinstance(exc, exceptions.ValidationError):
        fields = _flatten(exc.detail)
        return error_body(
            status_code=status_code,
            code="invalid",
            message=_summary(fields) or "Invalid input.",
            fields=fields,
        )
    if isinstance(exc, exceptions.ParseError):
        # `too_deep` (core.api.parsers) says what to change; any other is malformed.
        code = getattr(exc.detail, "code", None)
        return error_body(
            status_code=status_code,
            code=code if code and code != "parse_error" else "malformed_body",
            message=str(exc.detail),
        )
    detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
    code = getattr(exc, "default_code", "error")
    if isinstance(detail, dict | list):
        fields = _flatten(detail)
        body = error_body(
            status_code=status_code, code=code, message=_summary(fields), fields=fields
        )
    else:
        body = error_body(
            status_code=status_code,
            code=getattr(detail, "code", None) or code,
            message=str(detail),
        )
    if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
        body["error"]["details"] = {"retry_after_seconds": int(exc.wait)}
    return body


def json_404(request, exception=None):
    return JsonResponse(
        error_body(status_code=404, code="not_found", message="Not found."),
        status=status.HTTP_404_NOT_FOUND,
    )


def json_500(request):
    return JsonResponse(
        error_body(status_code=500, code="server_error", message="Internal server error."),
        status=500,
    )

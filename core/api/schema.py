"""The OpenAPI schema says what every operation may answer besides success: one error body
(core.api.errors) under the status codes the API really uses, so that clients, and
schemathesis's conformance checks in `make test`, can rely on it."""

from drf_spectacular.views import SpectacularAPIView

from core.api.throttle_scopes import EXPORTS

ERROR_COMPONENT = "ErrorResponse"
_ERROR_REF = {"$ref": f"#/components/schemas/{ERROR_COMPONENT}"}

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "status": {"type": "integer"},
                "code": {"type": "string"},
                "message": {"type": "string"},
                "fields": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "string"}},
                    "description": "Field path (dotted, with list indexes) → its reasons.",
                },
                "details": {"type": "object", "additionalProperties": True},
            },
            "required": ["status", "code", "message"],
        }
    },
    "required": ["error"],
}

_DESCRIPTIONS = {
    "400": "Bad input: `fields` names each field at fault and why.",
    "401": "Not signed in: no API key or session, or a revoked, expired or malformed key.",
    "403": "Signed in, but this caller may not do this (role or scope).",
    "404": "No such object, or one this caller may not see.",
    "409": "The request conflicts with the current state (e.g. insufficient capacity).",
    "413": "The request body is too large.",
    "415": "The body is not JSON.",
    "503": "A store this answer needs cannot be reached now; nothing was stored. Retry.",
}
# Beyond the codes every operation of its kind may answer.
_EXTRA = {("/api/v1/usage/events", "post"): ["503"]}
_WRITES = {"post", "put", "patch", "delete"}


def document_error_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook: the error responses of every operation."""
    result.setdefault("components", {}).setdefault("schemas", {})[ERROR_COMPONENT] = ERROR_SCHEMA
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            codes = ["400", "401", "403", "404"]
            if method in _WRITES:
                codes += ["409"]
            if "requestBody" in operation:
                codes += ["413", "415"]
            codes += _EXTRA.get((path, method), [])
            if operation.get("security") == [{}]:
                codes = [c for c in codes if c not in ("401", "403")]
            responses = operation["responses"]
            for code in codes:
                responses.setdefault(
                    code,
                    {
                        "description": _DESCRIPTIONS[code],
                        "content": {"application/json": {"schema": _ERROR_REF}},
                    },
                )
    return result


class SchemaView(SpectacularAPIView):
    """GET /api/schema/, open to anyone: the schema is the same for every install (it is built
    from the code), and clients read it before they hold a key. Building it takes a good part
    of a second and answers about 1 MB, so each caller (its key, user, or for an anonymous one
    its address) gets API_THROTTLE_EXPORTS of them."""

    throttle_scope = EXPORTS

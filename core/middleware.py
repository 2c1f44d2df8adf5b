"""Requests refused before any view reads them."""

from django.http import HttpResponseBadRequest, HttpResponseNotFound, JsonResponse

from core.api.errors import error_body
from core.bounds import has_control_characters


class RefuseControlCharacters:
    """A control character (NUL, a line break, ...) in the path or the query string: no name
    holds one, and PostgreSQL cannot even compare text holding NUL, so a lookup would answer
    500. A path holding one names nothing (404); a query parameter holding one is a 400 naming
    it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        api = request.path.startswith("/api/")
        if has_control_characters(request.path):
            if api:
                body = error_body(status_code=404, code="not_found", message="Not found.")
                return JsonResponse(body, status=404)
            return HttpResponseNotFound("Not found.")
        refused = sorted(
            {
                key
                for key, values in request.GET.lists()
                if has_control_characters(key) or any(map(has_control_characters, values))
            }
        )
        if refused:
            message = "A query parameter must not contain control characters."
            if api:
                body = error_body(
                    status_code=400,
                    code="invalid",
                    message=message,
                    fields={key: ["must not contain control characters."] for key in refused},
                )
                return JsonResponse(body, status=400)
            return HttpResponseBadRequest(message)
        return self.get_response(request)

"""Pagination: pages by number for the catalogue's short lists, by cursor (keyset) for lists
that grow without bound (usage receipts)."""

import base64
import binascii
import json
from datetime import UTC, datetime

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Q, QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import BasePagination, PageNumberPagination
from rest_framework.response import Response
from rest_framework.utils.urls import remove_query_param, replace_query_param


class StandardPagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


def keyset_after(queryset: QuerySet, ordering: tuple[str, ...], values: tuple) -> QuerySet:
    """The rows strictly after `values` in `ordering` (e.g. ("-finished_at", "-id")), which
    must be unique: (a, b) after (x, y) is a beyond x, or a = x and b beyond y. The first field
    is also bounded on its own, so the database reads one range of an index on the fields."""
    condition = Q()
    equal = Q()
    for name, value in zip(ordering, values, strict=True):
        field = name.lstrip("-")
        beyond = Q(**{f"{field}__{'lt' if name.startswith('-') else 'gt'}": value})
        condition |= equal & beyond
        equal &= Q(**{field: value})
    first = ordering[0]
    bound = {f"{first.lstrip('-')}__{'lte' if first.startswith('-') else 'gte'}": values[0]}
    return queryset.filter(**bound).filter(condition)


def _reversed(ordering: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name[1:] if name.startswith("-") else f"-{name}" for name in ordering)


# A cursor is client input: what it holds must be something the database can compare.
_BIGINT = 2**63


def _comparable(value):
    if value is None:
        raise ValueError("empty")
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("naive")
        return value.astimezone(UTC)  # OverflowError past year 9999
    if isinstance(value, int) and not -_BIGINT <= value < _BIGINT:
        raise ValueError("out of range")
    return value


def _value_of(row, field: str):
    return row[field] if isinstance(row, dict) else getattr(row, field)


class KeysetPagination(BasePagination):
    """Cursor pagination over the view's unique `keyset_ordering`: the cursor holds the last
    row's ordering values, and the next page is the rows strictly after it. Unlike offsets, a
    page deep in a million rows costs what the first costs, and rows arriving meanwhile never
    shift a page (nothing is skipped or repeated). Answers {next, previous, results}; the
    cursor is opaque to clients, and a bad one is a 400 naming `cursor`."""

    page_size = 100
    max_page_size = 1000
    cursor_query_param = "cursor"
    page_size_query_param = "page_size"

    def paginate_queryset(self, queryset, request, view=None):
        self.ordering = tuple(view.keyset_ordering)
        self.request = request
        self.limit = self._page_size(request)
        position, backwards = self._decode(request, queryset.model)
        ordering = _reversed(self.ordering) if backwards else self.ordering
        rows = queryset.order_by(*ordering)
        if position is not None:
            rows = keyset_after(rows, ordering, position)
        rows = list(rows[: self.limit + 1])
        more = len(rows) > self.limit
        rows = rows[: self.limit]
        if backwards:
            rows.reverse()
            self.has_next, self.has_previous = True, more
        else:
            self.has_next, self.has_previous = more, position is not None
        self.rows = rows
        return rows

    def _page_size(self, request) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None or raw == "":
            return self.page_size
        try:
            size = int(raw)
        except ValueError:
            size = 0
        if not 1 <= size <= self.max_page_size:
            raise ValidationError(
                {"page_size": [f"must be a whole number from 1 to {self.max_page_size}."]}
            )
        return size

    def _encode(self, row, *, backwards: bool) -> str:
        values = [_value_of(row, name.lstrip("-")) for name in self.ordering]
        shown = [v.isoformat() if isinstance(v, datetime) else v for v in values]
        text = json.dumps({"after": shown, "backwards": backwards}, separators=(",", ":"))
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    def _decode(self, request, model) -> tuple[tuple | None, bool]:
        raw = request.query_params.get(self.cursor_query_param)
        if not raw:
            return None, False
        try:
            text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
            data = json.loads(text)
            after = data["after"]
            if not isinstance(after, list) or len(after) != len(self.ordering):
                raise ValueError
            values = tuple(
                model._meta.get_field(name.lstrip("-")).to_python(value)
                for name, value in zip(self.ordering, after, strict=True)
            )
            values = tuple(_comparable(value) for value in values)
            return values, bool(data.get("backwards", False))
        except (
            ValueError,
            TypeError,
            KeyError,
            OverflowError,
            binascii.Error,
            DjangoValidationError,
        ):
            raise ValidationError(
                {"cursor": ["is not a cursor of this list: use the next or previous link."]}
            ) from None

    def _link(self, row, *, backwards: bool) -> str:
        url = self.request.build_absolute_uri()
        url = replace_query_param(url, self.page_size_query_param, self.limit)
        return replace_query_param(
            url, self.cursor_query_param, self._encode(row, backwards=backwards)
        )

    def get_next_link(self) -> str | None:
        if not self.has_next:
            return None
        if not self.rows:  # an empty page reached backwards: start again from the top
            return remove_query_param(self.request.build_absolute_uri(), self.cursor_query_param)
        return self._link(self.rows[-1], backwards=False)

    def get_previous_link(self) -> str | None:
        if not self.has_previous or not self.rows:
            return None
        return self._link(self.rows[0], backwards=True)

    def get_paginated_response(self, data):
        return Response(
            {"next": self.get_next_link(), "previous": self.get_previous_link(), "results": data}
        )

    def get_paginated_response_schema(self, schema):
        return {
            "type": "object",
            "required": ["results"],
            "properties": {
                "next": {"type": "string", "nullable": True, "format": "uri"},
                "previous": {"type": "string", "nullable": True, "format": "uri"},
                "results": schema,
            },
        }

    def get_schema_operation_parameters(self, view):
        return [
            {
                "name": self.cursor_query_param,
                "required": False,
                "in": "query",
                "description": "Where the page starts: the `next` or `previous` link's cursor.",
                "schema": {"type": "string"},
            },
            {
                "name": self.page_size_query_param,
                "required": False,
                "in": "query",
                "description": f"Rows per page, 1 to {self.max_page_size} "
                f"(default {self.page_size}).",
                "schema": {"type": "integer", "minimum": 1, "maximum": self.max_page_size},
            },
        ]

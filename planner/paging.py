"""One page of a long list: every planner list is paginated (10,000 customers stay fast)."""

from collections.abc import Sequence
from typing import Any, TypeVar

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import HttpRequest

PER_PAGE = 50

Row = TypeVar("Row")


def page_of(
    request: HttpRequest,
    queryset: QuerySet[Any, Row] | Sequence[Row],
    *,
    per_page: int = PER_PAGE,
    param: str = "page",
) -> Page[Row]:
    """The requested page; an out-of-range or malformed number gives the nearest real page."""
    return Paginator(queryset, per_page).get_page(request.GET.get(param))


def query_without(request: HttpRequest, param: str = "page") -> str:
    """The current query string without `param`, for page links that keep the filters."""
    query = request.GET.copy()
    query.pop(param, None)
    return query.urlencode()

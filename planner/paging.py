"""One page of a long list: every planner list is paginated (10,000 customers stay fast)."""

from django.core.paginator import Paginator

PER_PAGE = 50


def page_of(request, queryset, *, per_page: int = PER_PAGE, param: str = "page"):
    """The requested page; an out-of-range or malformed number gives the nearest real page."""
    return Paginator(queryset, per_page).get_page(request.GET.get(param))


def query_without(request, param: str = "page") -> str:
    """The current query string without `param`, for page links that keep the filters."""
    query = request.GET.copy()
    query.pop(param, None)
    return query.urlencode()

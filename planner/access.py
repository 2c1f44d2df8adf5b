"""Who may open a planner page: staff planners only (accounts.principals.user_is_planner).

Anonymous visitors are sent to the login page; a signed-in user who is not a planner (a
customer's member, say) gets 403 and sees nothing of the fleet.
"""

from collections.abc import Callable
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, cast

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

from accounts.principals import user_is_planner

P = ParamSpec("P")


class PlannerView(Protocol[P]):
    """A planner page's view once guarded: the URL's arguments after the request, as the
    undecorated view takes them, and the mark that says the page is for planners only."""

    planner_only: bool

    def __call__(self, request: HttpRequest, /, *args: P.args, **kwargs: P.kwargs) -> HttpResponse:
        """The page, or the way to the login page for an anonymous visitor."""
        ...


def planner_required(view: Callable[Concatenate[HttpRequest, P], HttpResponse]) -> PlannerView[P]:
    """The view, served to staff planners only: the login page for anonymous visitors, 403 for
    anyone else signed in."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args: P.args, **kwargs: P.kwargs) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not user_is_planner(request.user):
            raise PermissionDenied("Planner pages are for staff planners.")
        return view(request, *args, **kwargs)

    guarded = cast("PlannerView[P]", wrapped)
    guarded.planner_only = True
    return guarded

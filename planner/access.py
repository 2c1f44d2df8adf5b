"""Who may open a planner page: staff planners only (accounts.principals.user_is_planner).

Anonymous visitors are sent to the login page; a signed-in user who is not a planner (a
customer's member, say) gets 403 and sees nothing of the fleet.
"""

from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied

from accounts.principals import user_is_planner


def planner_required(view):
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not user_is_planner(request.user):
            raise PermissionDenied("Planner pages are for staff planners.")
        return view(request, *args, **kwargs)

    wrapped.planner_only = True
    return wrapped

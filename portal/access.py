"""Who may open a portal page: a customer's members, for that customer only.

Every portal page's URL carries the customer's slug, and is served only to a signed-in member
of that customer. Anyone else signed in gets 404, the answer for a customer that does not
exist, so the portal never confirms that another customer exists. Anonymous visitors are sent
to the site's login page (django-axes guards it). Within a customer, owners manage its API
keys and its people; members and viewers read everything and change nothing. That is the
API's rule too: both read it from accounts.scopes.ROLE_SCOPES.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, cast, overload

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse

from accounts import scopes as S
from accounts.models import Customer, Membership
from accounts.selectors import membership_of_user


@dataclass(frozen=True)
class PortalAccess:
    """The customer a portal page is about, and the signed-in user's role in it."""

    customer: Customer
    role: str

    @property
    def manages_keys(self) -> bool:
        """Creates and revokes the customer's keys, and removes its people (its owners)."""
        return S.role_manages_keys(self.role)

    @property
    def role_label(self) -> str:
        """The role in words, as the pages show it."""
        return Membership.Role(self.role).label


P = ParamSpec("P")

# What a portal page's view takes: the request, the caller's access, then the URL's other
# arguments.
PortalView = Callable[Concatenate[HttpRequest, PortalAccess, P], HttpResponse]


class PortalPage(Protocol[P]):
    """A portal page's view once guarded: the request, the URL's `slug`, then the URL's other
    arguments as the view takes them; marked as a portal page."""

    portal_page: bool

    def __call__(
        self, request: HttpRequest, slug: str, /, *args: P.args, **kwargs: P.kwargs
    ) -> HttpResponse:
        """The page, or the way to the login page for an anonymous visitor."""
        ...


@overload
def portal_page(view: PortalView[P], *, owners_only: bool = False) -> PortalPage[P]: ...


@overload
def portal_page(
    view: None = None, *, owners_only: bool = False
) -> Callable[[PortalView[P]], PortalPage[P]]: ...


def portal_page(
    view: PortalView[P] | None = None, *, owners_only: bool = False
) -> PortalPage[P] | Callable[[PortalView[P]], PortalPage[P]]:
    """A view of one customer's portal: `view(request, access, ...)`, the URL's `slug` turned
    into the caller's PortalAccess. With owners_only, members get 403 (they may see the page
    the action belongs to, so the refusal can say why)."""

    def decorate(view: PortalView[P]) -> PortalPage[P]:
        @wraps(view)
        def wrapped(
            request: HttpRequest, slug: str, *args: P.args, **kwargs: P.kwargs
        ) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            membership = membership_of_user(request.user, slug)
            if membership is None:
                raise Http404("No such customer.")
            access = PortalAccess(customer=membership.customer, role=membership.role)
            if owners_only and not access.manages_keys:
                raise PermissionDenied("Only the customer's owners manage its API keys and people.")
            return view(request, access, *args, **kwargs)

        page = cast("PortalPage[P]", wrapped)
        page.portal_page = True
        return page

    return decorate(view) if view is not None else decorate

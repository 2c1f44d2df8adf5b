"""Who may open a portal page: a customer's members, for that customer only.

Every portal page's URL carries the customer's slug, and is served only to a signed-in member
of that customer. Anyone else signed in gets 404, the answer for a customer that does not
exist, so the portal never confirms that another customer exists. Anonymous visitors are sent
to the site's login page (django-axes guards it). Within a customer, owners manage its API
keys and its people; members and viewers read everything and change nothing. That is the
API's rule too: both read it from accounts.scopes.ROLE_SCOPES.
"""

from dataclasses import dataclass
from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404

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
        return Membership.Role(self.role).label


def portal_page(view=None, *, owners_only: bool = False):
    """A view of one customer's portal: `view(request, access, ...)`, the URL's `slug` turned
    into the caller's PortalAccess. With owners_only, members get 403 (they may see the page
    the action belongs to, so the refusal can say why)."""

    def decorate(view):
        @wraps(view)
        def wrapped(request, slug, *args, **kwargs):
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            membership = membership_of_user(request.user, slug)
            if membership is None:
                raise Http404("No such customer.")
            access = PortalAccess(customer=membership.customer, role=membership.role)
            if owners_only and not access.manages_keys:
                raise PermissionDenied("Only the customer's owners manage its API keys and people.")
            return view(request, access, *args, **kwargs)

        wrapped.portal_page = True
        return wrapped

    return decorate(view) if view is not None else decorate

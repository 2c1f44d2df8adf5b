"""A customer's people and the keys each made: drawn by the planner's customer page and the
portal's people page alike, as the customer's chart is (charts.py)."""

from django.core.paginator import Page
from django.http import HttpRequest

from accounts.models import Customer, Membership
from accounts.selectors import live_api_keys_made_by, people_of_customer
from accounts.services import RemovedMembership
from planner.paging import page_of


def people_page(
    request: HttpRequest, customer: Customer, *, per_page: int = 20
) -> Page[Membership]:
    """A page of the customer's people, each with `keys_made`: the unrevoked keys they made
    (what removing them offers to revoke). The portal's people page shows the same."""
    page = page_of(request, people_of_customer(customer), param="people_page", per_page=per_page)
    memberships = list(page.object_list)
    made = live_api_keys_made_by(customer, [membership.user_id for membership in memberships])
    for membership in memberships:
        # For the template only: the keys removing the person offers to revoke.
        membership.keys_made = made[membership.user_id]  # type: ignore[attr-defined]
    page.object_list = memberships
    return page


def removed_message(removed: RemovedMembership, customer: Customer) -> str:
    """What removing a person did to them and their keys, in words (the portal says the same)."""
    text = f"{removed.username} ({removed.role}) removed from {customer.name}."
    if removed.revoked:
        prefixes = ", ".join(key.prefix for key in removed.revoked)
        text += f" The {len(removed.revoked)} key(s) they made are revoked: {prefixes}."
    if removed.kept:
        prefixes = ", ".join(key.prefix for key in removed.kept)
        text += f" The {len(removed.kept)} key(s) they made keep working: {prefixes}."
    return text

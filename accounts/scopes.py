"""What an API key may do, and what a person's role in a customer lets them do. A key's scopes
narrow what its owner could do anyway.

This is the one home of the role rule: the portal (portal.access) and the API
(accounts.principals) both read ROLE_SCOPES, so a role means the same on every surface.
"""

READ = "read"  # read what the owner can see
WRITE = "write"  # change the owner's own objects (e.g. its keys)
USAGE_WRITE = "usage:write"  # post usage events (gateways)
ADMISSION = "admission"  # ask for admission decisions and send requests (gateways)
RESERVATIONS_WRITE = "reservations:write"  # sell capacity (provisioning services)
CATALOG_WRITE = "catalog:write"  # change GPU types, pools, models, deployments (service keys)
CUSTOMERS_WRITE = "customers:write"  # create customers and their keys (provisioning services)

CUSTOMER_SCOPES = (READ, WRITE, USAGE_WRITE, ADMISSION)
SERVICE_SCOPES = (
    READ,
    WRITE,
    USAGE_WRITE,
    ADMISSION,
    RESERVATIONS_WRITE,
    CATALOG_WRITE,
    CUSTOMERS_WRITE,
)
ALL_SCOPES = SERVICE_SCOPES

DEFAULT_CUSTOMER_SCOPES = [READ, WRITE]
DEFAULT_SERVICE_SCOPES = [READ]

# A person's role in a customer (accounts.Membership.Role's values) → what a signed-in person
# of that role may do for that customer. Owners manage the customer's keys and people (write);
# members and viewers read. A customer's wish is that only its owners hand out credentials,
# so a member may not create or revoke keys on any surface (issue 34).
ROLE_SCOPES: dict[str, frozenset[str]] = {
    "owner": frozenset({READ, WRITE}),
    "member": frozenset({READ}),
    "viewer": frozenset({READ}),
}


def role_manages_keys(role: str | None) -> bool:
    """May a person of this role create and revoke the customer's keys (and remove its
    people)? None (no role in the customer) may not."""
    return WRITE in ROLE_SCOPES.get(role or "", frozenset())

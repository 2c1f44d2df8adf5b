"""What an API key may do. A key's scopes narrow what its owner could do anyway."""

READ = "read"  # read what the owner can see
WRITE = "write"  # change the owner's own objects (e.g. its keys)
USAGE_WRITE = "usage:write"  # post usage events (gateways)
ADMISSION = "admission"  # ask for admission decisions (gateways)
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

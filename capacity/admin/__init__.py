"""Capacity's admin pages, one module per room whose models they administer.

Django's autodiscovery imports `capacity.admin` only: importing each module below is what
registers its ModelAdmins, so a new module must be added here or its pages do not exist.
"""

from capacity.admin import (  # noqa: F401 - registers their ModelAdmins
    admission,
    allocation,
    catalog,
    health,
    metering,
    pricing,
    selling,
)

from django.apps import AppConfig


class PortalConfig(AppConfig):
    """The customer portal: a customer's owners and members see their own usage, keys, limits
    and invoices, server-rendered over the other apps' selectors and services."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "portal"
    verbose_name = "Customer portal"

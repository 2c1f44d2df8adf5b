from django.apps import AppConfig
from django.db.models.signals import post_migrate


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Accounts: customers, tiers, memberships and API keys"

    def ready(self) -> None:
        # Imported here, not at the top: Django loads this module before any app's models, and
        # these import models.
        from accounts.services import ensure_planners_group
        from accounts.tiers import ensure_default_tiers

        post_migrate.connect(ensure_default_tiers, sender=self)
        # After django.contrib.auth's own receiver made this app's permissions: the planners
        # group holds the ones planners need (an install made before they were granted gets
        # them at its next migrate).
        post_migrate.connect(ensure_planners_group, sender=self)

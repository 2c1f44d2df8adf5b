from django.apps import AppConfig
from django.db.models.signals import post_migrate


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Accounts: customers, tiers, memberships and API keys"

    def ready(self) -> None:
        from accounts.tiers import ensure_default_tiers

        post_migrate.connect(ensure_default_tiers, sender=self)

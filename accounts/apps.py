from django.apps import AppConfig
from django.db.models.signals import post_migrate


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Accounts: customers, tiers, memberships and API keys"

    def ready(self) -> None:
        from accounts.tiers import ensure_default_tiers

        post_migrate.connect(ensure_default_tiers, sender=self)
        # After django.contrib.auth's own receiver made this app's permissions: the planners
        # group holds the ones planners need (an install made before they were granted gets
        # them at its next migrate).
        post_migrate.connect(ensure_planners_group, sender=self)


def ensure_planners_group(sender=None, *, apps=None, using="default", **kwargs) -> None:
    from accounts.services import planners_group_ensure

    if apps is None:
        from django.apps import apps
    try:
        apps.get_model("auth", "Group")
        apps.get_model("auth", "Permission")
    except LookupError:  # auth not migrated yet
        return
    planners_group_ensure(apps=apps, using=using)

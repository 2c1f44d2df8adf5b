from django.core.management.base import BaseCommand
from django.utils import timezone

from accounts import scopes as S
from accounts.selectors import service_keys_by_gateway_access


class Command(BaseCommand):
    help = (
        "List the platform's live service keys in two groups: those holding `admission`, which "
        "a gateway lets send requests (for the customer they name), and those without it, "
        "which a gateway refuses (403 insufficient_scope). After upgrading, the second group "
        "is the keys that lost gateway access."
    )

    def handle(self, *args, **options):
        with_admission, without = service_keys_by_gateway_access(now=timezone.now())
        self._group(
            f"Service keys a gateway accepts ({S.ADMISSION}): {len(with_admission)}",
            with_admission,
        )
        self.stdout.write("")
        self._group(
            f"Service keys a gateway refuses (no {S.ADMISSION}): {len(without)}",
            without,
            hint=(
                "A gateway's key needs admission: create a new key with "
                "`manage.py create_api_key --service NAME --scopes read usage:write admission` "
                "and revoke the old one (a key's scopes never change)."
            ),
        )

    def _group(self, title: str, api_keys, *, hint: str = "") -> None:
        self.stdout.write(self.style.MIGRATE_HEADING(title))
        if not api_keys:
            self.stdout.write("  none")
            return
        for api_key in api_keys:
            used = (
                api_key.last_used_at.strftime("%Y-%m-%d %H:%M") if api_key.last_used_at else "never"
            )
            self.stdout.write(
                f"  {api_key.prefix}  service:{api_key.service_name}  {api_key.name!r}  "
                f"scopes: {', '.join(api_key.scopes)}  last used: {used}"
            )
        if hint:
            self.stdout.write(hint)

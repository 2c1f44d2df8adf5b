from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from accounts import scopes as S
from accounts.models import Customer
from accounts.services import api_key_create
from core.errors import DomainError


class Command(BaseCommand):
    help = "Create an API key for a customer or a platform service and print it once."

    def add_arguments(self, parser):
        owner = parser.add_mutually_exclusive_group(required=True)
        owner.add_argument("--customer", metavar="SLUG")
        owner.add_argument("--service", metavar="NAME")
        parser.add_argument("--name", default="", help="A label for people reading key lists.")
        parser.add_argument(
            "--scopes",
            nargs="+",
            metavar="SCOPE",
            help=f"Any of: {', '.join(S.ALL_SCOPES)}. Default: read, write for a customer key; "
            "read for a service key.",
        )
        parser.add_argument("--expires", type=int, metavar="DAYS", help="Days until it expires.")
        parser.add_argument(
            "--quiet", action="store_true", help="Print only the key (for scripts)."
        )

    def handle(self, *args, customer, service, name, scopes, expires, quiet, **options):
        owner = None
        if customer:
            owner = Customer.objects.filter(slug=customer).first()
            if owner is None:
                raise CommandError(f"No customer with slug '{customer}'.")
        if expires is not None and expires < 1:
            raise CommandError("--expires must be at least 1 day.")
        try:
            created = api_key_create(
                name=name or f"{customer or service} key",
                customer=owner,
                service_name=service or "",
                scopes=scopes,
                expires_at=timezone.now() + timedelta(days=expires) if expires else None,
                actor="system:manage.py create_api_key",
            )
        except DomainError as error:
            raise CommandError(f"{error.field}: {error.message}") from None
        if quiet:
            self.stdout.write(created.plaintext)
            return
        api_key = created.api_key
        self.stdout.write(f"Owner:   {api_key.owner_label}")
        self.stdout.write(f"Scopes:  {', '.join(api_key.scopes)}")
        self.stdout.write(f"Expires: {api_key.expires_at or 'never'}")
        self.stdout.write(self.style.SUCCESS(f"Key:     {created.plaintext}"))
        self.stdout.write("Keep it now: it is not stored and cannot be shown again.")

"""Key pairs for signed publications (docs/gateway-contract.md, "Signed publications").

manage.py publication_keys new --id 2026-12   a new pair: the private half for the control
                                              plane's PUBLICATION_SIGNING_KEY, the public
                                              half for the gateways' GATEWAY_PUBLICATION_KEYS
manage.py publication_keys public             the public half of the configured key
"""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from capacity.publication import signing


class Command(BaseCommand):
    help = "Make a publication signing key pair, or print the configured key's public half."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["new", "public"])
        parser.add_argument(
            "--id",
            default="k1",
            help="The new key's id (letters, digits, '-'); a rotation's keys differ in it.",
        )

    def handle(self, *args: object, **options: object) -> None:
        if options["action"] == "public":
            try:
                public = signing.public_spec(settings.PUBLICATION_SIGNING_KEY)
            except signing.SigningKeyError as error:
                raise CommandError(f"PUBLICATION_SIGNING_KEY: {error}") from None
            if not public:
                raise CommandError("PUBLICATION_SIGNING_KEY is not set: publications are unsigned")
            self.stdout.write(public)
            return
        key_id = str(options["id"])
        try:
            private, public = signing.generate(key_id)
            signing.parse_private_key(private)  # the id's spelling, checked as settings will
        except signing.SigningKeyError as error:
            raise CommandError(str(error)) from None
        self.stdout.write(f"PUBLICATION_SIGNING_KEY={private}")
        self.stdout.write(f"GATEWAY_PUBLICATION_KEYS={public}")
        self.stderr.write(
            "The first line is secret: give it to the control plane only. During a rotation a "
            "gateway holds the old and the new public key, comma-separated."
        )

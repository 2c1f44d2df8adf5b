"""Redis's ACL users for a deployment (capacity/publication/redis_acl.py).

manage.py redis_acl rules     the gateway user's rules, no password (for ACL SETUSER or a
                              chart's values)
manage.py redis_acl print     an aclfile: the default user off, `controlplane` and `gateway`
                              with the passwords in REDIS_ACL_CONTROL_PLANE_PASSWORD and
                              REDIS_ACL_GATEWAY_PASSWORD (environment, never arguments:
                              arguments stay in shell history and process lists)
"""

from __future__ import annotations

import os

from django.core.management.base import BaseCommand, CommandError, CommandParser

from capacity.publication.redis_acl import acl_lines, gateway_rules

PASSWORD_VARIABLES = ("REDIS_ACL_CONTROL_PLANE_PASSWORD", "REDIS_ACL_GATEWAY_PASSWORD")


class Command(BaseCommand):
    help = "Print Redis's ACL users: the gateway's rules, or a whole aclfile."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["rules", "print"])

    def handle(self, *args: object, **options: object) -> None:
        if options["action"] == "rules":
            self.stdout.write(gateway_rules())
            return
        missing = [name for name in PASSWORD_VARIABLES if not os.environ.get(name)]
        if missing:
            raise CommandError(f"set {' and '.join(missing)} (32+ characters each)")
        try:
            lines = acl_lines(
                control_plane_password=os.environ[PASSWORD_VARIABLES[0]],
                gateway_password=os.environ[PASSWORD_VARIABLES[1]],
            )
        except ValueError as error:
            raise CommandError(str(error)) from None
        self.stdout.write("\n".join(lines))

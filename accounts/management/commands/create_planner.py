import getpass
import os

from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from accounts.services import planner_create


class Command(BaseCommand):
    help = (
        "Create (or update) a staff planner. The password comes from PLANNER_PASSWORD, "
        "or is prompted for."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--email", default="")
        parser.add_argument(
            "--skip-password-validation",
            action="store_true",
            help="Accept a password that Django's validators reject (demo accounts only).",
        )

    def handle(self, *args, username, email, skip_password_validation, **options):
        password = os.environ.get("PLANNER_PASSWORD")
        if not password:
            if not os.isatty(0):
                raise CommandError("Set PLANNER_PASSWORD or run in a terminal to be prompted.")
            password = getpass.getpass("Password: ")
            if password != getpass.getpass("Password (again): "):
                raise CommandError("The passwords differ.")
        if not skip_password_validation:
            try:
                validate_password(password)
            except ValidationError as error:
                raise CommandError("Password rejected: " + " ".join(error.messages)) from None
        _, created = planner_create(username=username, password=password, email=email)
        verb = "Created" if created else "Updated"
        self.stdout.write(self.style.SUCCESS(f"{verb} planner '{username}'."))

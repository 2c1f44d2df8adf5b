"""python manage.py generate_invoices --period 2026-11 [--customer SLUG ...]"""

from django.core.management.base import BaseCommand, CommandError

from accounts.models import Customer
from billing.generation import invoice_generate
from core.errors import DomainError


class Command(BaseCommand):
    help = (
        "Generate (or regenerate) the draft invoices of a month; issued invoices are never touched."
    )

    def add_arguments(self, parser):
        parser.add_argument("--period", required=True, help="The month, YYYY-MM.")
        parser.add_argument("--customer", action="append", help="Only these customers (slug).")

    def handle(self, *args, **options):
        customers = None
        if options["customer"]:
            customers = list(Customer.objects.filter(slug__in=options["customer"]))
            missing = set(options["customer"]) - {c.slug for c in customers}
            if missing:
                raise CommandError(f"no customer {sorted(missing)[0]!r}")
        try:
            result = invoice_generate(period=options["period"], customers=customers)
        except DomainError as exc:
            raise CommandError(f"--period: {exc.message}") from exc
        self.stdout.write(
            f"{result.period}: {result.drafts} draft invoice(s), "
            f"{result.skipped_issued} customer(s) already issued (left as they are)"
        )
        for problem in result.unpriced:
            self.stderr.write(f"unpriced: {problem}")

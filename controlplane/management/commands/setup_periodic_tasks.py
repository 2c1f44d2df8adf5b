from django.core.management.base import BaseCommand

from benchmarking.schedules import sync_benchmark_schedules
from billing.schedules import billing_schedules_sync
from capacity.schedules import sync_capacity_schedules


class Command(BaseCommand):
    help = (
        "Create or update the periodic tasks (nightly benchmarks of deployments that enable "
        "them, the stale-run reaper). Idempotent; times stay editable in the admin."
    )

    def add_arguments(self, parser):
        parser.add_argument("--nightly-hour-utc", type=int, default=2, choices=range(24))

    def handle(self, *args, nightly_hour_utc, **options):
        counts = sync_benchmark_schedules(hour_utc=nightly_hour_utc)
        capacity_tasks = sync_capacity_schedules()
        billing_schedules_sync()
        self.stdout.write(
            f"Nightly benchmarks: {counts['nightly']} deployment(s) "
            f"({counts['created']} new, {counts['disabled']} disabled). "
            "Stale-run reaper: every 60 s."
        )
        self.stdout.write(f"Capacity tasks (rollups, reservation status): {capacity_tasks}.")
        self.stdout.write("Billing: last month's draft invoices at 03:00 UTC on the 1st.")

from django.core.management.base import BaseCommand

from benchmarking.schedules import benchmarking_schedules_sync
from billing.schedules import billing_schedules_sync
from capacity.schedules import capacity_schedules_sync


class Command(BaseCommand):
    help = (
        "Create or update the periodic tasks (nightly benchmarks of deployments that enable "
        "them, each at its benchmark_hour_utc; the stale-run reaper). Idempotent."
    )

    def handle(self, *args: object, **options: object) -> None:
        # Each app writes its own rows: the same call, the same kind of answer.
        counts = benchmarking_schedules_sync()
        capacity_tasks = capacity_schedules_sync()["periodic"]
        billing_schedules_sync()
        self.stdout.write(
            f"Nightly benchmarks: {counts['nightly']} deployment(s) "
            f"({counts['created']} new, {counts['disabled']} disabled). "
            "Stale-run reaper: every 60 s."
        )
        self.stdout.write(f"Capacity tasks (rollups, reservation status): {capacity_tasks}.")
        self.stdout.write("Billing: last month's draft invoices at 03:00 UTC on the 1st.")

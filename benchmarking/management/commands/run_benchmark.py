import time

from django.core.management.base import BaseCommand, CommandError

from benchmarking.management.commands._output import print_json
from benchmarking.models import BenchmarkRun, BenchmarkSuite
from benchmarking.services import run_queue
from capacity.models import Deployment
from core.errors import DomainError


class Command(BaseCommand):
    help = "Queue a benchmark run of a deployment on the benchmarks queue; --wait follows it."

    def add_arguments(self, parser):
        parser.add_argument("--suite", required=True)
        parser.add_argument("--deployment", required=True)
        parser.add_argument("--endpoint", default="", help="Override the deployment's endpoint.")
        parser.add_argument("--replicas", type=int, default=1)
        parser.add_argument("--wait", action="store_true", help="Follow progress until it ends.")
        parser.add_argument("--poll-seconds", type=float, default=2.0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, suite, deployment, endpoint, replicas, wait, poll_seconds, **options):
        suite_row = BenchmarkSuite.objects.filter(name=suite).first()
        if suite_row is None:
            raise CommandError(f"No benchmark suite named '{suite}'.")
        deployment_row = Deployment.objects.filter(name=deployment).first()
        if deployment_row is None:
            raise CommandError(f"No deployment named '{deployment}'.")
        try:
            run = run_queue(
                suite=suite_row, deployment=deployment_row, endpoint_url=endpoint, replicas=replicas
            )
        except DomainError as error:
            raise CommandError(error.message) from None
        if not options["json"]:
            self.stdout.write(f"Queued benchmark run {run.pk} of {deployment} ({suite}).")
        if wait:
            last_message = None
            while run.status in (BenchmarkRun.Status.QUEUED, BenchmarkRun.Status.RUNNING):
                time.sleep(poll_seconds)
                run.refresh_from_db()
                message = (
                    f"[{run.status}] {run.progress_done}/{run.progress_total} shapes — "
                    f"{run.progress_message}"
                )
                if message != last_message and not options["json"]:
                    self.stdout.write(message)
                    last_message = message
        if options["json"]:
            print_json(
                self.stdout,
                {
                    "run": run.pk,
                    "status": run.status,
                    "error": run.error,
                    "fit_error": run.fit_error,
                },
            )
            return
        if wait:
            style = (
                self.style.SUCCESS
                if run.status == BenchmarkRun.Status.SUCCEEDED
                else self.style.ERROR
            )
            self.stdout.write(
                style(f"Run {run.pk} {run.status}. {run.error or run.fit_error}".strip())
            )
            if run.status == BenchmarkRun.Status.FAILED:
                raise CommandError(f"Run {run.pk} failed: {run.error}")

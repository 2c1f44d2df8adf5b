from django.core.management.base import BaseCommand, CommandError

from benchmarking.management.commands._output import cost_model_dict, print_fit_report, print_json
from benchmarking.models import BenchmarkRun
from benchmarking.services import cost_model_fit
from capacity.models import GpuType, ServedModel
from core.errors import DomainError


class Command(BaseCommand):
    help = (
        "Fit a new cost-model version from a succeeded benchmark run (default: the latest for "
        "the model and GPU type). It becomes active when its CV MAPE is under the threshold "
        "and it changes prices on the last 7 days of traffic by little enough; otherwise it "
        "waits for a planner, and the report says why."
    )

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True)
        parser.add_argument("--gpu", required=True)
        parser.add_argument("--gpus-per-replica", type=int)
        parser.add_argument("--run", type=int, help="A benchmark run id.")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, model, gpu, gpus_per_replica, run, json, **options):
        served_model = ServedModel.objects.filter(name=model).first()
        if served_model is None:
            raise CommandError(f"No served model named '{model}'.")
        gpu_type = GpuType.objects.filter(name=gpu).first()
        if gpu_type is None:
            raise CommandError(f"No GPU type named '{gpu}'.")
        benchmark_run = None
        if run is not None:
            benchmark_run = BenchmarkRun.objects.filter(pk=run).first()
            if benchmark_run is None:
                raise CommandError(f"No benchmark run {run}.")
            if (benchmark_run.served_model_id, benchmark_run.gpu_type_id) != (
                served_model.pk,
                gpu_type.pk,
            ):
                raise CommandError(
                    f"Run {run} measured {benchmark_run.served_model.name} on "
                    f"{benchmark_run.gpu_type.name}, not {model} on {gpu}."
                )
        try:
            cost_model = cost_model_fit(
                run=benchmark_run,
                served_model=served_model,
                gpu_type=gpu_type,
                gpus_per_replica=gpus_per_replica,
            )
        except DomainError as error:
            raise CommandError(error.message) from None
        if json:
            print_json(self.stdout, cost_model_dict(cost_model))
        else:
            print_fit_report(self.stdout, cost_model)

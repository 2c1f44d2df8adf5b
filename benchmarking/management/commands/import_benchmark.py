from decimal import Decimal, InvalidOperation
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from benchmarking.management.commands._output import print_json
from benchmarking.services import benchmark_import
from controlplane.errors import DomainError


class Command(BaseCommand):
    help = (
        "Import a throughput table (CSV: input_len,output_len,requests_per_s per replica; "
        "optional ttft_p95_ms,tpot_p95_ms,concurrency,cached_input_len) as a benchmark run. "
        "Creates the served model and GPU type when they do not exist yet."
    )

    def add_arguments(self, parser):
        parser.add_argument("file", type=Path)
        parser.add_argument("--model", required=True, help="Served model name.")
        parser.add_argument("--gpu", required=True, help="GPU type name.")
        parser.add_argument("--gpus-per-replica", type=int, default=1)
        parser.add_argument("--gpu-memory-gb", type=int, default=80, help="For a new GPU type.")
        parser.add_argument("--gpu-hourly-cost-usd", default="0", help="For a new GPU type.")
        parser.add_argument("--engine-model-id", default="", help="For a new served model.")
        parser.add_argument("--fit", action="store_true", help="Fit a cost model right after.")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **options):
        path: Path = options["file"]
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"Cannot read {path}: {error}") from None
        try:
            cost = Decimal(options["gpu_hourly_cost_usd"])
        except InvalidOperation:
            raise CommandError("--gpu-hourly-cost-usd must be a number.") from None
        try:
            run, created = benchmark_import(
                csv_text=text,
                model_name=options["model"],
                gpu_name=options["gpu"],
                gpus_per_replica=options["gpus_per_replica"],
                source_detail=path.name,
                gpu_memory_gb=options["gpu_memory_gb"],
                gpu_hourly_cost_usd=cost,
                engine_model_id=options["engine_model_id"],
            )
        except DomainError as error:
            raise CommandError(f"{path}: {error.message}") from None
        payload = {"run": run.pk, "rows": run.samples.count(), "created": created}
        if options["fit"]:
            from benchmarking.management.commands._output import cost_model_dict
            from benchmarking.services import cost_model_fit

            try:
                payload["cost_model"] = cost_model_dict(cost_model_fit(run=run))
            except DomainError as error:
                raise CommandError(
                    f"Imported as run {run.pk}, but cannot fit: {error.message}"
                ) from None
        if options["json"]:
            print_json(self.stdout, payload)
            return
        for what in created:
            self.stdout.write(f"Created {what}.")
        self.stdout.write(
            self.style.SUCCESS(
                f"Imported {payload['rows']} shapes from {path.name} as run {run.pk}."
            )
        )
        if "cost_model" in payload:
            model = payload["cost_model"]
            self.stdout.write(
                f"Fitted version {model['version']} ({model['status']}): "
                f"CV MAPE {model['cv_mape']:.2%}."
            )

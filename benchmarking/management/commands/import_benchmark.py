from decimal import Decimal, InvalidOperation
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from benchmarking import importers
from benchmarking.management.commands._output import cost_model_dict, print_json
from benchmarking.services import benchmark_import, cost_model_fit
from core.errors import DomainError


def _short_names(paths: list[Path]) -> list[str]:
    """Each path by its shortest tail that tells it from the others: genai-perf and AIPerf
    name every run's file alike (profile_export_genai_perf.json), in a directory per run."""
    parts = [path.parts for path in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        tails = ["/".join(p[-depth:]) for p in parts]
        if len(set(tails)) == len(tails):
            return tails
    return [str(path) for path in paths]


class Command(BaseCommand):
    help = (
        "Import benchmark results as a benchmark run: a throughput table (CSV: input_len,"
        "output_len,requests_per_s per replica; optional ttft_p95_ms,tpot_p95_ms,concurrency,"
        "cached_input_len) or the result files of vLLM's `vllm bench serve --save-result`, "
        "genai-perf (profile_export_genai_perf.json), AIPerf (profile_export_aiperf.json) or "
        "trtllm-bench (--report_json), one file per run or several. Creates the served model "
        "and GPU type when they do not exist yet."
    )

    def add_arguments(self, parser):
        parser.add_argument("files", type=Path, nargs="+", metavar="file")
        parser.add_argument(
            "--format",
            default=importers.AUTO,
            choices=[importers.AUTO, *importers.FORMATS],
            help="Which tool wrote the files (default: told by their content).",
        )
        parser.add_argument("--model", required=True, help="Served model name.")
        parser.add_argument("--gpu", required=True, help="GPU type name.")
        parser.add_argument(
            "--gpus-per-replica",
            type=int,
            default=None,
            help="GPUs of one replica (default: what a trtllm-bench report says, else 1).",
        )
        parser.add_argument(
            "--replicas",
            type=int,
            default=1,
            help="Replicas behind the measured endpoint; a tool's throughput is divided by it.",
        )
        parser.add_argument("--gpu-memory-gb", type=int, default=80, help="For a new GPU type.")
        parser.add_argument("--gpu-hourly-cost-usd", default="0", help="For a new GPU type.")
        parser.add_argument("--engine-model-id", default="", help="For a new served model.")
        parser.add_argument("--fit", action="store_true", help="Fit a cost model right after.")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **options):
        paths: list[Path] = options["files"]
        files = []
        for path in paths:
            try:
                files.append((str(path), path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as error:
                raise CommandError(f"Cannot read {path}: {error}") from None
        try:
            cost = Decimal(options["gpu_hourly_cost_usd"])
        except InvalidOperation:
            raise CommandError("--gpu-hourly-cost-usd must be a number.") from None
        names = ", ".join(_short_names(paths))
        try:
            run, created = benchmark_import(
                files=files,
                file_format=options["format"],
                model_name=options["model"],
                gpu_name=options["gpu"],
                gpus_per_replica=options["gpus_per_replica"],
                replicas=options["replicas"],
                source_detail=names,
                gpu_memory_gb=options["gpu_memory_gb"],
                gpu_hourly_cost_usd=cost,
                engine_model_id=options["engine_model_id"],
            )
        except DomainError as error:
            raise CommandError(error.message) from None
        shapes = run.samples.filter(sustainable=True).count()
        payload = {
            "run": run.pk,
            "rows": run.samples.count(),
            "shapes": shapes,
            "gpus_per_replica": run.gpus_per_replica,
            "created": created,
        }
        if options["fit"]:
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
        what = (
            f"{shapes} shapes"
            if payload["rows"] == shapes
            else f"{payload['rows']} records ({shapes} shapes)"
        )
        source = names if len(paths) <= 3 else f"{len(paths)} files"
        self.stdout.write(self.style.SUCCESS(f"Imported {what} from {source} as run {run.pk}."))
        if "cost_model" in payload:
            model = payload["cost_model"]
            self.stdout.write(
                f"Fitted version {model['version']} ({model['status']}): "
                f"CV MAPE {model['cv_mape']:.2%}."
            )

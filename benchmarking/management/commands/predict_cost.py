import csv
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from benchmarking.csv_import import _positive_int
from capacity.models import GpuType, ServedModel
from capacity.pricing.cost_models import pricing_cost_model
from capacity.pricing.estimates import price_shapes
from core.errors import DomainError


class Command(BaseCommand):
    help = (
        "Read input_len,output_len rows and print CSV input_len,output_len,replica_seconds,mu,"
        "requests_per_s from the active cost model (or the latest candidate)."
    )

    def add_arguments(self, parser):
        parser.add_argument("file", help="CSV with input_len,output_len; '-' for stdin.")
        parser.add_argument("--model", required=True)
        parser.add_argument("--gpu", required=True)

    def handle(self, *args, file, model, gpu, **options):
        served_model = ServedModel.objects.filter(name=model).first()
        if served_model is None:
            raise CommandError(f"No served model named '{model}'.")
        gpu_type = GpuType.objects.filter(name=gpu).first()
        if gpu_type is None:
            raise CommandError(f"No GPU type named '{gpu}'.")
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"Cannot read {file}: {error}") from None
        reader = csv.DictReader(text.splitlines())
        missing = {"input_len", "output_len"} - set(reader.fieldnames or [])
        if missing:
            raise CommandError(f"{file}: missing column(s) {', '.join(sorted(missing))}.")
        rows = []
        try:
            for raw in reader:
                line = reader.line_num
                rows.append(
                    {
                        "input_tokens": _positive_int(
                            raw["input_len"], column="input_len", line=line, allow_zero=True
                        ),
                        "output_tokens": _positive_int(
                            raw["output_len"], column="output_len", line=line, allow_zero=True
                        ),
                    }
                )
            cost_model = pricing_cost_model(served_model=served_model, gpu_type=gpu_type)
        except DomainError as error:
            raise CommandError(f"{file}: {error.message}") from None
        self.stderr.write(
            f"# {model} on {gpu}: cost model v{cost_model.version} ({cost_model.status})"
        )
        writer = csv.writer(self.stdout, lineterminator="\n")
        writer.writerow(["input_len", "output_len", "replica_seconds", "mu", "requests_per_s"])
        for priced in price_shapes(cost_model, rows):
            rps = priced["requests_per_s"]
            writer.writerow(
                [
                    priced["input_tokens"],
                    priced["output_tokens"],
                    f"{priced['replica_seconds']:.6g}",
                    f"{priced['mu']:.6g}",
                    "" if rps is None else f"{rps:.6g}",
                ]
            )

from django.db.models import QuerySet

from benchmarking.models import BenchmarkRun, BenchmarkSample, BenchmarkSuite


def suites() -> QuerySet[BenchmarkSuite]:
    return BenchmarkSuite.objects.all()


def runs() -> QuerySet[BenchmarkRun]:
    return BenchmarkRun.objects.select_related("suite", "deployment", "served_model", "gpu_type")


def samples_of(run: BenchmarkRun) -> QuerySet[BenchmarkSample]:
    return run.samples.order_by("input_len", "output_len", "concurrency", "id")

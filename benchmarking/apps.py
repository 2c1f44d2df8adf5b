from django.apps import AppConfig


class BenchmarkingConfig(AppConfig):
    name = "benchmarking"
    verbose_name = "Benchmarking: suites, runs, samples"

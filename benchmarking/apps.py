from django.apps import AppConfig


class BenchmarkingConfig(AppConfig):
    name = "benchmarking"
    verbose_name = "Benchmarking: suites, runs, samples"

    def ready(self) -> None:
        # Imported here, not at the top: Django loads this module before any app's models, and
        # these import models. capacity cannot import benchmarking (the dependency order), so
        # benchmarking subscribes to its deployments' writes: the suite and the nightly beat
        # row it owns are written in the deployment's transaction.
        from benchmarking.references import (
            deployment_references_delete,
            deployment_references_write,
        )
        from capacity.hooks import on_deployment_deleted, on_deployment_written

        on_deployment_written(deployment_references_write)
        on_deployment_deleted(deployment_references_delete)

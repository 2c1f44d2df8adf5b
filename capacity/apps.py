from django.apps import AppConfig


class CapacityConfig(AppConfig):
    name = "capacity"
    verbose_name = "Capacity: fleet catalog"

    def ready(self) -> None:
        # Every process of the control plane may publish: none starts with a malformed
        # publication signing key, or without one when DEBUG is off.
        from capacity.publication.publish import publication_signing_key

        publication_signing_key()

        # accounts cannot import capacity (the dependency order), so capacity subscribes to
        # its key writes: a created or revoked key reaches gateways right after the commit.
        from accounts.hooks import on_keys_changed
        from capacity.publication import publish_keys_changed

        on_keys_changed(publish_keys_changed)

        from capacity.telemetry.desired import DesiredReplicasCollector
        from core import metrics_view

        if not any(
            isinstance(c, DesiredReplicasCollector) for c in metrics_view.scrape_time_collectors
        ):
            metrics_view.scrape_time_collectors.append(DesiredReplicasCollector())

        from capacity.telemetry.oversold import OversoldCollector

        if not any(isinstance(c, OversoldCollector) for c in metrics_view.scrape_time_collectors):
            metrics_view.scrape_time_collectors.append(OversoldCollector())

        from capacity.allocation.heartbeat import readiness
        from capacity.telemetry.tick_age import TickAgeCollector
        from core import liveness

        if not any(isinstance(c, TickAgeCollector) for c in metrics_view.scrape_time_collectors):
            metrics_view.scrape_time_collectors.append(TickAgeCollector())
        # A stale tick shows as "degraded" in /readyz (still 200).
        liveness.degrading_checks["allocation_tick"] = readiness

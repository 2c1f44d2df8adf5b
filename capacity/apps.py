from django.apps import AppConfig


class CapacityConfig(AppConfig):
    name = "capacity"
    verbose_name = "Capacity: fleet catalog"

    def ready(self) -> None:
        # Imported here, not at the top: Django loads this module before any app's models, and
        # these import models. This is the one place capacity's subscriptions are made.
        from accounts.hooks import on_keys_changed
        from capacity.allocation.gauges import DesiredReplicasCollector, TickAgeCollector
        from capacity.allocation.heartbeat import readiness
        from capacity.allocation.wake import request_tick
        from capacity.hooks import on_gateway_state_changed, on_tick_wanted
        from capacity.publication.publish import (
            publication_signing_key,
            publish_changed_state,
            publish_keys_changed,
        )
        from capacity.telemetry.oversold import OversoldCollector
        from core import liveness, metrics_view

        # Every process of the control plane may publish: none starts with a malformed
        # publication signing key, or without one when DEBUG is off.
        publication_signing_key()

        # accounts cannot import capacity (the dependency order), so capacity subscribes to
        # its key writes: a created or revoked key reaches gateways right after the commit.
        on_keys_changed(publish_keys_changed)
        # capacity's lower rooms announce through capacity.hooks what its upper ones act on:
        # a write gateways must see, and a probe round that wants a tick now.
        on_gateway_state_changed(publish_changed_state)
        on_tick_wanted(request_tick)

        # Gauges read from the database at each scrape of /metrics.
        for collector in (DesiredReplicasCollector, OversoldCollector, TickAgeCollector):
            if not any(isinstance(c, collector) for c in metrics_view.scrape_time_collectors):
                metrics_view.scrape_time_collectors.append(collector())
        # A stale tick shows as "degraded" in /readyz (still 200).
        liveness.degrading_checks["allocation_tick"] = readiness

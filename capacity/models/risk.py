from django.db import models

from capacity.models.catalog import ServedModel


class CapacityRisk(models.Model):
    """A model's sold capacity that the fleet cannot serve, as last checked: its "oversold"
    state and the allocation tick's guaranteed shortfall (capacity.selling.at_risk).

    One row per model, written by every re-check (a catalogue or pricing change, every tick).
    A state is entered when its MU/min becomes positive and left when it returns to 0; each
    change sends one signed alert. /metrics reads these rows when scraped.
    """

    served_model = models.OneToOneField(
        ServedModel, on_delete=models.CASCADE, primary_key=True, related_name="capacity_risk"
    )
    # The sold MU/min the fleet's best assignment of GPUs leaves unserved, at the worst moment
    # from now on (the linear programme of capacity.selling.feasibility).
    oversold_mu_per_minute = models.FloatField(default=0.0)
    oversold_at = models.DateTimeField(
        null=True, blank=True, help_text="The moment the shortfall is worst."
    )
    oversold_since = models.DateTimeField(
        null=True, blank=True, help_text="When the model became oversold; empty: it is not."
    )
    reservations_at_risk = models.JSONField(
        default=list, blank=True, help_text="Ids of the reservations in term while it is short."
    )
    # Sold capacity the tick cannot make hot (capacity.allocation.policy), as of its last tick.
    guaranteed_shortfall_mu_per_minute = models.FloatField(default=0.0)
    guaranteed_shortfall_since = models.DateTimeField(null=True, blank=True)
    checked_at = models.DateTimeField()

    class Meta:
        ordering = ["served_model_id"]

    def __str__(self) -> str:
        return f"{self.served_model_id}: oversold {self.oversold_mu_per_minute:g} MU/min"

    @property
    def oversold(self) -> bool:
        return self.oversold_since is not None

    @property
    def short(self) -> bool:
        return self.guaranteed_shortfall_since is not None

from django.db import models

from capacity.models.catalog import ServedModel


class CapacitySample(models.Model):
    """One minute of a model's capacity as the allocation loop saw it: the fleet page's charts.

    Written at most once per model per minute (capacity.metering.history), so
    the last 24 h and 7 days of deployable / hot / sellable / sold / used can be drawn without
    replaying decisions. Old rows are pruned after CAPACITY_HISTORY_DAYS.
    """

    served_model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="+")
    minute = models.DateTimeField(help_text="The whole UTC minute the sample stands for.")
    deployable_mu_per_minute = models.FloatField()
    hot_mu_per_minute = models.FloatField()
    sellable_mu_per_minute = models.FloatField()
    sold_mu_per_minute = models.FloatField()
    used_mu_per_minute = models.FloatField()
    # Sold MU/min the fleet cannot serve (capacity.selling.at_risk) and the tick's guaranteed
    # shortfall, as the last re-check stored them when the minute was sampled.
    oversold_mu_per_minute = models.FloatField(default=0.0)
    guaranteed_shortfall_mu_per_minute = models.FloatField(default=0.0)

    class Meta:
        ordering = ["served_model_id", "minute"]
        constraints = [
            # serves: capacity.metering.history.capacity_history (a model's samples over a range)
            models.UniqueConstraint(
                fields=["served_model", "minute"], name="capacitysample_one_per_minute"
            )
        ]

    def __str__(self) -> str:
        return f"{self.served_model_id} {self.minute:%Y-%m-%d %H:%M}"

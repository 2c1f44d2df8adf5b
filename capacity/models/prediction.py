from django.db import models

from capacity.models.catalog import ServedModel


class ModelPrediction(models.Model):
    """A model's prediction state (capacity.allocation.policy rule 3c): the forecast fitted on a
    schedule (capacity.allocation.forecasting), and what the last tick did with it: the SLO
    correction in force (read by the next tick), the delivered SLO it was corrected by, the burst
    headroom and the forecast's lift, and which part set the target. One row per model."""

    served_model = models.OneToOneField(
        ServedModel, on_delete=models.CASCADE, related_name="prediction"
    )
    # The fitted curve (capacity.allocation.forecast.Forecast.as_dict); {} until a fit had enough
    # history. `fit_note` says why there is none, or what was fitted.
    forecast = models.JSONField(default=dict, blank=True)
    fitted_at = models.DateTimeField(null=True, blank=True)
    fit_note = models.CharField(max_length=200, blank=True)
    # The first minute of the model's recorded demand within the fit's lookback (null: none):
    # how long its traffic has been recorded, read by the tick without scanning the rollups.
    demand_since = models.DateTimeField(null=True, blank=True)
    # Written by the tick.
    slo_correction = models.FloatField(default=1.0)
    slo_code = models.CharField(max_length=40, blank=True)
    delivered_slo_attainment = models.FloatField(null=True, blank=True)
    delivered_requests = models.PositiveIntegerField(default=0)
    burst_headroom_mu_per_minute = models.FloatField(default=0.0)
    forecast_now_mu_per_minute = models.FloatField(null=True, blank=True)
    forecast_lift_mu_per_minute = models.FloatField(default=0.0)
    set_by = models.CharField(max_length=40, blank=True)
    predictive = models.BooleanField(default=False)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["served_model_id"]

    def __str__(self) -> str:
        return f"prediction of {self.served_model_id}"

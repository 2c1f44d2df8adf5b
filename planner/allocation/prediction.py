"""The allocation page's prediction panel: per model, rule 3c of capacity.allocation.policy as
the last tick applied it (which part set the target, the burst headroom, the SLO correction in
force and the delivered attainment it came from), and the forecast's band drawn beside the
demand used and the capacity hot of the last hours, and the day ahead.

A model without a ModelPrediction row (no tick or fit has written one yet) still gets a panel:
"no forecast yet", never an error.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Exists, OuterRef
from django.utils import timezone

from capacity.allocation.forecast import Forecast
from capacity.allocation.policy import SET_BY_LABELS
from capacity.allocation.slo import SLO_CODE_LABELS
from capacity.catalog.selectors import served_models_by_name
from capacity.metering.history import capacity_history
from capacity.models import Deployment, ModelPrediction, ServedModel
from planner.charts import ChartConfig, chart_window, line_chart, time_label

# What the chart shows: the measured demand of the last hours, and the forecast's day ahead
# (its curve reaches HORIZON_STEPS, one day, past its fit). A quarter hour a point, 120 over the
# 30 hours, whatever the forecast's own step: each point is the mean of the steps it holds.
PAST = timedelta(hours=6)
AHEAD = timedelta(hours=24)
STEP = timedelta(minutes=15)

STATE_LABELS = {"on": "on", "off": "off", "warming_up": "warming up"}


@dataclass(frozen=True)
class PredictionPanel:
    """One model's prediction, ready for the template."""

    model: ServedModel
    prediction: ModelPrediction | None
    state: str  # "on", "off" (the planner's switch) or "warming_up" (too little traffic yet)
    forecast: Forecast | None
    # Why there is no forecast to draw, when there is none ("" when there is one).
    no_forecast_note: str
    chart: ChartConfig | None
    chart_id: str

    @property
    def state_label(self) -> str:
        return STATE_LABELS[self.state]

    @property
    def set_by_label(self) -> str:
        code = self.prediction.set_by if self.prediction else ""
        return SET_BY_LABELS.get(code, code)

    @property
    def slo_code_label(self) -> str:
        code = self.prediction.slo_code if self.prediction else ""
        return SLO_CODE_LABELS.get(code, code)

    @property
    def history_days(self) -> float:
        """The demand history the forecast was fitted on, in days."""
        return self.forecast.history_minutes / (24 * 60) if self.forecast is not None else 0.0

    @property
    def attainment_percent(self) -> float | None:
        """The delivered SLO attainment, a share stored, as a percentage shown."""
        if self.prediction is None or self.prediction.delivered_slo_attainment is None:
            return None
        return self.prediction.delivered_slo_attainment * 100


def prediction_of(served_model: ServedModel) -> ModelPrediction | None:
    """The model's prediction row (fetched with select_related("prediction")), or None."""
    try:
        return served_model.prediction
    except ModelPrediction.DoesNotExist:
        return None


def prediction_state(served_model: ServedModel, prediction: ModelPrediction | None) -> str:
    """Off by the planner's switch; on once the last tick applied rule 3c; warming up before
    (the model's traffic is younger than the burst window the rule needs, or no tick has
    written the row yet)."""
    if not served_model.prediction_enabled:
        return "off"
    if prediction is not None and prediction.predictive:
        return "on"
    return "warming_up"


def _stored_forecast(prediction: ModelPrediction | None) -> tuple[Forecast | None, str]:
    """(the fitted forecast, or None and why not)."""
    if prediction is None or not prediction.forecast:
        note = prediction.fit_note if prediction is not None else ""
        return None, note or "no fit has run yet"
    try:
        forecast = Forecast.from_dict(prediction.forecast)
    except (KeyError, TypeError, ValueError, AssertionError):
        # A row written by another version of the fit: the page stays up and says so.
        return None, "the stored forecast could not be read"
    if forecast.step_seconds <= 0:
        # No step, no curve to walk (and the chart's walk along it would never end).
        return None, "the stored forecast could not be read"
    if not forecast.mu_per_minute:
        return None, prediction.fit_note or "the fit gave no curve"
    return forecast, ""


def _forecast_mean(forecast: Forecast, from_s: float, span_s: float) -> float | None:
    """The forecast's mean over [from_s, from_s + span_s): each of its own steps there read
    once, in its middle; None where the curve does not reach."""
    values = []
    step_s = forecast.step_seconds
    t_s = from_s + min(step_s, span_s) / 2
    while t_s < from_s + span_s:
        value = forecast.at(t_s)
        if value is not None:
            values.append(value)
        t_s += step_s
    return sum(values) / len(values) if values else None


def _chart(
    forecast: Forecast | None,
    history: dict[datetime, dict[str, float]],
    moments: list[datetime],
    span: timedelta,
) -> ChartConfig | None:
    """Demand used and capacity hot (each step's mean) beside the forecast and its 80 % band;
    None when there is neither a sample nor a forecast in the window."""

    def measured(key: str) -> list[float | None]:
        return [round(history[m][key], 2) if m in history else None for m in moments]

    step_s = STEP.total_seconds()
    expected = [
        None if forecast is None else _forecast_mean(forecast, m.timestamp(), step_s)
        for m in moments
    ]
    if not history and all(value is None for value in expected):
        return None
    band_mu = forecast.band_mu_per_minute if forecast is not None else 0.0

    def shifted(by_mu: float) -> list[float | None]:
        # Demand is never negative: the band's low edge stops at zero.
        return [None if v is None else round(max(0.0, v + by_mu), 2) for v in expected]

    faint = {"pointRadius": 0, "borderWidth": 0}
    return line_chart(
        [time_label(m, span) for m in moments],
        [
            {"label": "Used", "color": "#dc2626", "data": measured("used")},
            {"label": "Hot (replicas ready)", "color": "#16a34a", "data": measured("hot")},
            # The band: its low edge, then its high edge filled down to it ("-1": the dataset
            # before); the two must stay adjacent.
            {"label": "80 % band: low", "color": "#2563eb", "data": shifted(-band_mu), **faint},
            {
                "label": "80 % band: high",
                "color": "#2563eb",
                "data": shifted(band_mu),
                "fill": "-1",
                **faint,
            },
            {
                "label": "Forecast",
                "color": "#2563eb",
                "data": shifted(0.0),
                "borderDash": [6, 4],
            },
        ],
        y_title="MU per minute",
    )


def prediction_summary(served_model: ServedModel) -> PredictionPanel:
    """The model's panel without its chart (a deployment's page): one query."""
    prediction = prediction_of(served_model)
    forecast, note = _stored_forecast(prediction)
    return PredictionPanel(
        model=served_model,
        prediction=prediction,
        state=prediction_state(served_model, prediction),
        forecast=forecast,
        no_forecast_note=note,
        chart=None,
        chart_id="",
    )


def prediction_panels(*, now: datetime | None = None) -> list[PredictionPanel]:
    """Every model the loop sizes (one with a deployment), by name, with its prediction and
    chart: two queries, whatever the number of models."""
    now = now or timezone.now()
    served_models = list(
        served_models_by_name()
        .filter(Exists(Deployment.objects.filter(served_model=OuterRef("pk"))))
        .select_related("prediction")
    )
    if not served_models:
        return []
    start, now_end = chart_window(now, PAST, STEP)
    end = now_end + AHEAD
    span = end - start
    moments = [start + i * STEP for i in range(int(span / STEP))]
    history = capacity_history([m.pk for m in served_models], start=start, end=now_end, step=STEP)
    panels = []
    for served_model in served_models:
        prediction = prediction_of(served_model)
        forecast, note = _stored_forecast(prediction)
        panels.append(
            PredictionPanel(
                model=served_model,
                prediction=prediction,
                state=prediction_state(served_model, prediction),
                forecast=forecast,
                no_forecast_note=note,
                chart=_chart(forecast, history[served_model.pk], moments, span),
                chart_id=f"prediction-chart-{served_model.pk}",
            )
        )
    return panels

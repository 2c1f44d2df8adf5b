"""A model's demand, forecast: the level the next cold start and the next hour will bring.

Fitted on a schedule (the live control plane's `capacity.demand_forecast_fit`, the simulator's
ModelUnitAutoscaler once a simulated hour) from the per-minute demand the control plane already
keeps (served MU plus the refused requests' estimated MU, all customers together); only
evaluated in the tick (`Forecast.at`, `Forecast.peak_between`: a lookup in the fitted curve), so
its cost stays out of the tick's budget.

The method: Holt-Winters exponential smoothing (statsmodels' `ExponentialSmoothing`) with an
additive damped trend and an additive season, on five-minute means (a morning ramp takes
minutes; quarter hours would blur it past a cold start). Chosen because:

- demand has one strong season at a time for this purpose: the day, or the week (which holds
  the days) once two weeks are known; one seasonal component of the right period is enough,
  where MSTL or a state-space model with several would cost more to fit for the same curve;
- it is cheap: with the heuristic initialisation only the four smoothing parameters are
  optimised (two weeks of five-minute means, 4,032 points, fit in a few seconds), where SARIMAX
  with a 288- or 2,016-step season is far slower;
- the damped trend is the short-term trend, and it flattens instead of running away over the
  hour ahead.

Too little history (under two days: two seasons of the daily period) gives no forecast: the
policy keeps its reactive rules and says so. Pure (no database, no clock).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STEP_SECONDS = 300
DAY_STEPS = 24 * 3600 // STEP_SECONDS
WEEK_STEPS = 7 * DAY_STEPS
# The least history for a forecast: two days, two seasons of the daily period (the heuristic
# initialisation's need); two weeks for the weekly season.
MIN_HISTORY_MINUTES = 2 * 24 * 60
WEEKLY_HISTORY_MINUTES = 14 * 24 * 60
# Kept for a fit: the last four weeks at most (older weeks would only slow the fit).
MAX_HISTORY_MINUTES = 28 * 24 * 60
# The fitted curve reaches this far ahead; a forecast older than its reach is not used.
HORIZON_STEPS = DAY_STEPS
# The band drawn beside demand: the 80 % interval of a normal error of the fit's residuals.
BAND_Z = 1.2816


@dataclass(frozen=True)
class Forecast:
    """A fitted curve of demand, MU/min, one value per STEP_SECONDS from `start_s`."""

    start_s: float  # the start of the first step ahead (the end of the history), epoch s
    step_seconds: int
    mu_per_minute: tuple[float, ...]
    band_mu_per_minute: float  # half the width of the 80 % band
    method: str  # "holt-winters daily" or "holt-winters weekly"
    history_minutes: int

    @property
    def end_s(self) -> float:
        return self.start_s + self.step_seconds * len(self.mu_per_minute)

    def at(self, t_s: float) -> float | None:
        """The forecast demand of the step holding `t_s`; None outside the curve."""
        if not self.mu_per_minute or t_s < self.start_s or t_s >= self.end_s:
            return None
        return self.mu_per_minute[int((t_s - self.start_s) // self.step_seconds)]

    def peak_between(self, from_s: float, to_s: float) -> float | None:
        """The highest forecast demand of the steps [from_s, to_s] touches (within the curve);
        None when the curve does not cover `from_s`. A step's value, not a blend of two: a
        ramp inside the next step is planned for once the horizon reaches that step."""
        first = self.at(from_s)
        if first is None:
            return None
        start = int((from_s - self.start_s) // self.step_seconds)
        end = int((min(to_s, self.end_s - 1e-6) - self.start_s) // self.step_seconds)
        return max(self.mu_per_minute[start : end + 1])

    def as_dict(self) -> dict[str, object]:
        """As stored (capacity.models.ModelPrediction.forecast)."""
        return {
            "start_s": self.start_s,
            "step_seconds": self.step_seconds,
            "mu_per_minute": list(self.mu_per_minute),
            "band_mu_per_minute": self.band_mu_per_minute,
            "method": self.method,
            "history_minutes": self.history_minutes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Forecast:
        values = data.get("mu_per_minute") or []
        assert isinstance(values, list)
        return cls(
            start_s=float(data["start_s"]),  # type: ignore[arg-type]
            step_seconds=int(data["step_seconds"]),  # type: ignore[call-overload]
            mu_per_minute=tuple(float(v) for v in values),
            band_mu_per_minute=float(data.get("band_mu_per_minute") or 0.0),  # type: ignore[arg-type]
            method=str(data.get("method") or ""),
            history_minutes=int(data.get("history_minutes") or 0),  # type: ignore[call-overload]
        )


def fit(per_minute_mu: Sequence[float], end_s: float) -> Forecast | None:
    """Fit the demand of the minutes given (oldest first, the last one ending at `end_s`);
    None with less than MIN_HISTORY_MINUTES of them."""
    minutes = np.asarray(per_minute_mu, dtype=float)[-MAX_HISTORY_MINUTES:]
    if minutes.size < MIN_HISTORY_MINUTES:
        return None
    per_step = STEP_SECONDS // 60
    # Steps on the clock's five minutes (a ramp at 08:00 is a step's edge, not inside one): the
    # minutes of the step in progress are left out, and the curve starts where it starts.
    partial = int(end_s // 60) % per_step
    if partial:
        minutes = minutes[:-partial]
        end_s = (int(end_s // 60) - partial) * 60.0
    if minutes.size < MIN_HISTORY_MINUTES:
        return None  # two days once the step in progress is left out
    whole = minutes.size // per_step * per_step
    steps = minutes[minutes.size - whole :].reshape(-1, per_step).mean(axis=1)
    weekly = minutes.size >= WEEKLY_HISTORY_MINUTES
    period = WEEK_STEPS if weekly else DAY_STEPS
    # Imported here: statsmodels costs about a second to import, and only the fitting task and
    # the simulator's fits need it, never the web process or the tick.
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    with warnings.catch_warnings():
        # Convergence chatter of the optimiser on flat or all-zero series; the fit stands.
        warnings.simplefilter("ignore")
        if float(np.ptp(steps)) <= 1e-9:
            ahead = np.full(HORIZON_STEPS, float(steps[-1]))
            residual = 0.0
        else:
            model = ExponentialSmoothing(
                steps,
                trend="add",
                damped_trend=True,
                seasonal="add",
                seasonal_periods=period,
                initialization_method="heuristic",
            )
            fitted = model.fit()
            ahead = np.asarray(fitted.forecast(HORIZON_STEPS), dtype=float)
            residual = float(np.std(np.asarray(fitted.resid, dtype=float)))
    ahead = np.clip(np.nan_to_num(ahead, nan=float(steps[-1])), 0.0, None)
    return Forecast(
        start_s=end_s,
        step_seconds=STEP_SECONDS,
        mu_per_minute=tuple(float(v) for v in ahead),
        band_mu_per_minute=BAND_Z * residual,
        method="holt-winters " + ("weekly" if weekly else "daily"),
        history_minutes=int(minutes.size),
    )


@dataclass(frozen=True)
class ForecastFigures:
    """What the policy reads of a forecast at a tick (ModelSnapshot's forecast fields)."""

    at_level_mu_per_minute: float | None  # when the measured level stands for
    ahead_mu_per_minute: float | None  # the highest within the next cold start (and tick)
    next_hour_peak_mu_per_minute: float | None  # the highest within the next hour


def figures(
    forecast: Forecast | None, now_s: float, *, horizon_seconds: float, level_age_seconds: float
) -> ForecastFigures:
    """The forecast at a tick. The measured level is a mean over the last minutes, so it stands
    for `level_age_seconds` ago (half its window): the forecast's rise is taken from there, not
    from now, or a ramp under way would be counted short by what it rose since."""
    if forecast is None or forecast.at(now_s) is None:
        return ForecastFigures(None, None, None)
    at_level = forecast.at(max(forecast.start_s, now_s - level_age_seconds))
    return ForecastFigures(
        at_level,
        forecast.peak_between(now_s, now_s + horizon_seconds),
        forecast.peak_between(now_s, now_s + 3600),
    )

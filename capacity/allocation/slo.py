"""Feedback from the delivered SLO: a bounded correction of what a replica is assumed to serve.

The policy sizes a fleet from cost models (MU/min a replica serves) and the traffic's bursts;
both are estimates. What the customers got is measured: the share of a model's requests whose
first token came within the TTFT SLO over the last SLO_WINDOW (usage events' `ttft_ms`; a
refused request counts as missed). Like the correction factors of Dynamo's planner (observed
TTFT over expected, applied to the profiled performance), the factor multiplies the capacity
per replica the policy assumes: met with margin, it grows (each replica is trusted with more,
the headroom shrinks); at risk, it falls (the headroom grows). Bounded on both sides, and
reported in the decision's reasons. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

# The measurement: the requests of the last SLO_WINDOW_SECONDS, and no change on fewer than
# SLO_MIN_REQUESTS of them (a handful of requests says nothing about a percentile).
SLO_WINDOW_SECONDS = 1800
SLO_MIN_REQUESTS = 200
# The factor follows the error budget's burn rate over the window (the share of requests
# missed over the share the objective allows), with a dead band: burnt under
# SLO_BURN_LEAN_BELOW, replicas are trusted with more (SLO_GAIN per unit of burn below it);
# over SLO_BURN_FATTEN_ABOVE, with less (the same gain); between, the cost model stands.
# Proportional, not integrating: an integrating factor learns the calm and is caught lean by
# the next ramp (measured in the simulator: Azure's conversation trace fell to 98.4 %
# attainment with one). The dead band keeps a fleet near its objective from paying for the
# factor's swings in whole replicas (Azure's conversation trace cost 2 % more GPU-hours
# without it, the code trace's SLO held either way).
SLO_BURN_LEAN_BELOW = 0.4
SLO_BURN_FATTEN_ABOVE = 1.0
SLO_GAIN = 0.4
SLO_FACTOR_MIN = 0.8
SLO_FACTOR_MAX = 1.25


# SloCorrection.code, as the planner words it.
SLO_CODE_LABELS = {
    "slo_met_with_margin": "met with margin",
    "slo_at_risk": "at risk",
    "slo_on_target": "on target",
    "slo_unmeasured": "unmeasured (too few requests)",
}


@dataclass(frozen=True)
class SloCorrection:
    factor: float  # the capacity per replica the policy assumes, as a multiple of the cost model's
    code: str  # "slo_met_with_margin", "slo_at_risk", "slo_on_target", "slo_unmeasured"
    message: str


def corrected(
    factor_in_force: float,
    attainment: float | None,
    requests: int,
    target: float,
    *,
    gain: float = SLO_GAIN,
) -> SloCorrection:
    """The factor for this tick from the delivered attainment (the share of the last SLO
    window's `requests` within the TTFT SLO); too few requests keep the one in force."""
    held = min(SLO_FACTOR_MAX, max(SLO_FACTOR_MIN, factor_in_force or 1.0))
    if attainment is None or requests < SLO_MIN_REQUESTS:
        return SloCorrection(
            held,
            "slo_unmeasured",
            f"{requests} request(s) in the SLO window, fewer than {SLO_MIN_REQUESTS}: the "
            f"correction stays at ×{held:.2f}",
        )
    allowed = max(1e-9, 1 - target)
    burn = (1 - attainment) / allowed
    if burn < SLO_BURN_LEAN_BELOW:
        raw = 1 + gain * (SLO_BURN_LEAN_BELOW - burn)
    elif burn > SLO_BURN_FATTEN_ABOVE:
        raw = 1 - gain * (burn - SLO_BURN_FATTEN_ABOVE)
    else:
        raw = 1.0
    factor = min(SLO_FACTOR_MAX, max(SLO_FACTOR_MIN, raw))
    bound = " (its bound)" if factor in (SLO_FACTOR_MIN, SLO_FACTOR_MAX) else ""
    said = (
        f"{attainment:.2%} of {requests} requests within the TTFT SLO (objective "
        f"{target:.1%}, error budget burnt at {burn:.1f}×): each replica counted at "
        f"×{factor:.2f} of its cost model{bound}"
    )
    if factor > 1 + 1e-3:
        return SloCorrection(factor, "slo_met_with_margin", said)
    if factor < 1 - 1e-3:
        return SloCorrection(factor, "slo_at_risk", said)
    return SloCorrection(factor, "slo_on_target", said)

"""Discrete-event simulation of one model's fleet (docs/design.md#the-simulator).

Pure Python + numpy, no Django. `simulate` replays a list of `TraceRequest`s against a fleet of
replicas that follow the engine emulator's ground truth (`ModelConfig`), under an `Autoscaler`
called every tick and an optional `Admission` policy, and returns a `SimulationResult`.
The simulation has no randomness of its own: the same trace, settings and autoscaler give the
same result, so a seeded trace (`simulation.engine.traces.load_trace(seed=...)`) gives a seeded run.
"""

from .admission import Admission, TokenBucketAdmission
from .autoscaling import Autoscaler, Observation, ScheduledAutoscaler, StaticAutoscaler
from .fleet import REFUSED, SERVED, TIMED_OUT, SimulationResult, SimulationSettings, simulate

__all__ = [
    "REFUSED",
    "SERVED",
    "TIMED_OUT",
    "Admission",
    "Autoscaler",
    "Observation",
    "ScheduledAutoscaler",
    "SimulationResult",
    "SimulationSettings",
    "StaticAutoscaler",
    "TokenBucketAdmission",
    "simulate",
]

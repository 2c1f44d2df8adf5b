"""The capacity app's models, one module per concept."""

from capacity.models.allocation import (
    ActuatorCircuit,
    AdmissionAllowance,
    AllocationDecision,
    TickHeartbeat,
)
from capacity.models.catalog import ActuatorKind, Deployment, GpuPool, GpuType, ServedModel
from capacity.models.cost_models import CostModel
from capacity.models.entitlements import Entitlement
from capacity.models.health import (
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    DeploymentFingerprint,
    Incident,
    IncidentStep,
    ProbeOutcome,
    ProbeResult,
    Replica,
)
from capacity.models.history import CapacitySample
from capacity.models.prediction import ModelPrediction
from capacity.models.request_limits import BudgetCap, RequestLimit
from capacity.models.reservations import Reservation, ReservationChange
from capacity.models.risk import CapacityRisk
from capacity.models.usage import (
    AdmissionClass,
    FallbackAdmission,
    Outcome,
    UsageEvent,
    UsageKeyMinute,
    UsageMinute,
    Verification,
)

__all__ = [
    "ActuatorCircuit",
    "AdmissionAllowance",
    "AllocationDecision",
    "ActuatorKind",
    "AdmissionClass",
    "BudgetCap",
    "CapacityRisk",
    "CapacitySample",
    "CostModel",
    "DegradationChange",
    "DegradationPolicy",
    "DegradationState",
    "DeploymentFingerprint",
    "Entitlement",
    "FallbackAdmission",
    "Incident",
    "IncidentStep",
    "ModelPrediction",
    "ProbeOutcome",
    "ProbeResult",
    "Replica",
    "RequestLimit",
    "Deployment",
    "GpuPool",
    "GpuType",
    "Outcome",
    "Reservation",
    "ReservationChange",
    "ServedModel",
    "TickHeartbeat",
    "UsageEvent",
    "UsageKeyMinute",
    "UsageMinute",
    "Verification",
]

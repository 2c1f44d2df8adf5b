"""The actuator for a deployment's `actuator_kind`."""

import importlib

from capacity.actuation.base import Actuator, PermanentActuatorError
from capacity.actuation.dry_run import DryRunActuator
from capacity.actuation.kubernetes import KubernetesActuator
from capacity.actuation.webhook import WebhookActuator

_PROCESS_MODULE = "capacity.actuation.process"

_ACTUATORS: dict[str, type[Actuator]] = {
    DryRunActuator.kind: DryRunActuator,
    KubernetesActuator.kind: KubernetesActuator,
    WebhookActuator.kind: WebhookActuator,
}


def actuator_for(kind: str) -> Actuator:
    """A fresh actuator of `kind`; PermanentActuatorError when there is none."""
    actuator_class = _ACTUATORS.get(kind)
    if actuator_class is not None:
        return actuator_class()
    if kind == "process":
        return _process_actuator()
    raise PermanentActuatorError(f"unknown actuator kind '{kind}'.")


def _process_actuator() -> Actuator:
    # Imported on demand: the process actuator is its own module, and a host that never runs
    # engine processes should not fail to load the other kinds because of it.
    try:
        module = importlib.import_module(_PROCESS_MODULE)
    except ModuleNotFoundError as error:
        if error.name == _PROCESS_MODULE:
            raise PermanentActuatorError("process actuator unavailable") from error
        # The module is there but something it needs is not: say what.
        raise PermanentActuatorError(f"process actuator unavailable: {error}") from error
    actuator_class = getattr(module, "ProcessActuator", None)
    if actuator_class is None:
        raise PermanentActuatorError("process actuator unavailable")
    return actuator_class()

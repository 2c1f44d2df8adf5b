"""An engine emulator: a test double of a vLLM data plane (see README.md).

Nothing in the control plane imports this package; tests, benchmarks and the demo start it.
"""

from simulation.engine.profile import ground_truth_replica_seconds, step_seconds

from .config import ConfigError, EmulatorConfig, ModelConfig, load_config, parse_config

__all__ = [
    "ConfigError",
    "EmulatorConfig",
    "ModelConfig",
    "ground_truth_replica_seconds",
    "load_config",
    "parse_config",
    "step_seconds",
]

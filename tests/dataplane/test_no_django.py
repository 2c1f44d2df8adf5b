"""The data plane and the simulator's engine run without Django: importing them, in a fresh
interpreter, leaves `django` (and the control plane's settings) out of `sys.modules`."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dataplane
import simulation.engine

ROOT = Path(__file__).resolve().parents[2]


def submodules(package) -> list[str]:
    found = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        if not info.name.endswith(".__main__"):  # importing a __main__ would run it
            found.append(info.name)
    return sorted(found)


@pytest.mark.parametrize(
    "modules",
    [
        ["dataplane.emulator"],
        ["dataplane.supervisor"],
        ["dataplane.gateway", "dataplane.gateway.server", "dataplane.gateway.runner"],
        ["simulation.engine"],
        submodules(dataplane),
        submodules(simulation.engine),
    ],
    ids=[
        "emulator",
        "supervisor",
        "gateway",
        "simulation.engine",
        "dataplane.*",
        "simulation.engine.*",
    ],
)
def test_importing_it_leaves_django_out(modules):
    code = "\n".join(
        [
            "import importlib, sys",
            f"for name in {modules!r}:",
            "    importlib.import_module(name)",
            "leaked = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'))",
            "print(leaked)",
        ]
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no DJANGO_SETTINGS_MODULE
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{modules} import Django: {done.stdout}"


def test_the_walk_finds_every_module():
    assert "dataplane.supervisor.server" in submodules(dataplane)
    assert "dataplane.emulator.server" in submodules(dataplane)
    assert "dataplane.gateway.server" in submodules(dataplane)
    assert "simulation.engine.modelunit" in submodules(simulation.engine)
    assert "simulation.engine.profile" in submodules(simulation.engine)

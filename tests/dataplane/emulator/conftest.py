import httpx
import pytest

from dataplane.emulator.background import BackgroundEmulator


@pytest.fixture
def start_emulator():
    """Start emulators on free ports in this process; all are stopped after the test."""
    started = []

    def start(config) -> BackgroundEmulator:
        emulator = BackgroundEmulator(config).start()
        started.append(emulator)
        return emulator

    yield start
    for emulator in started:
        emulator.stop()


@pytest.fixture
def http():
    # trust_env=False: a proxy from the environment must not sit between test and emulator.
    with httpx.Client(timeout=10, trust_env=False) as client:
        yield client

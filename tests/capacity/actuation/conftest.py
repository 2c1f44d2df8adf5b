import pytest

from capacity.actuation.base import ScaleRequest, apply_with_retries
from tests.support.scale_api import ScaleApiServer

_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # Both clients honour proxy variables; none may sit between a test and its local server.
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def scale_api():
    server = ScaleApiServer(token="k8s-token").start()
    yield server
    server.stop()


def scale_request(config: dict, *, target_replicas: int = 3, **overrides) -> ScaleRequest:
    values = {
        "deployment_id": 7,
        "deployment": "llama-8b-h100",
        "model": "llama-8b",
        "target_replicas": target_replicas,
        "current_replicas": 1,
        "config": config,
        "decision_id": 42,
        "reasons": [{"code": "demand", "mu_per_minute": 250.0}],
    } | overrides
    return ScaleRequest(**values)


def apply(actuator, request: ScaleRequest, *, max_attempts: int = 3):
    """apply_with_retries as the tick calls it, minus the backoff sleeps."""
    return apply_with_retries(actuator, request, max_attempts=max_attempts, sleep=lambda _: None)

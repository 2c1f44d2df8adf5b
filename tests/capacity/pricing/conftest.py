"""Last week's traffic for price reviews (tests/support/usage.py)."""

import numpy as np
import pytest

from tests.conftest import SIMPLE_WEIGHTS
from tests.support.usage import gateway_client, last_week_of_traffic

COST_MODELS = "/api/v1/cost-models/"


@pytest.fixture
def gateway(make_key, key_client):
    return gateway_client(make_key, key_client)


@pytest.fixture
def last_week(gateway, acme, globex, served_model, gpu_type):
    """v1 active; acme sent long answers (1000 in / 100 out), globex long prompts (4000 / 20)."""
    return last_week_of_traffic(gateway, served_model, gpu_type)


def weights_moving(*, acme: float, globex: float) -> dict:
    """SIMPLE_WEIGHTS with the input and output token weights chosen so that last week's
    shapes cost `acme` × (acme's 1000 in / 100 out) and `globex` × (globex's 4000 in / 20
    out) of what they cost under SIMPLE_WEIGHTS (the request weight is kept): two equations,
    two unknowns."""
    request = SIMPLE_WEIGHTS["request"]

    def seconds(input_tokens: int, output_tokens: int) -> float:
        return (
            SIMPLE_WEIGHTS["input_tokens"] * input_tokens
            + SIMPLE_WEIGHTS["output_tokens"] * output_tokens
            + request
        )

    input_weight, output_weight = np.linalg.solve(
        [[1000.0, 100.0], [4000.0, 20.0]],
        [acme * seconds(1000, 100) - request, globex * seconds(4000, 20) - request],
    )
    return SIMPLE_WEIGHTS | {
        "input_tokens": float(input_weight),
        "output_tokens": float(output_weight),
    }

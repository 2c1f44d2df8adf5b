"""Last week's traffic for price reviews (tests/support/usage.py)."""

import pytest

from tests.support.usage import gateway_client, last_week_of_traffic

COST_MODELS = "/api/v1/cost-models/"


@pytest.fixture
def gateway(make_key, key_client):
    return gateway_client(make_key, key_client)


@pytest.fixture
def last_week(gateway, acme, globex, served_model, gpu_type):
    """v1 active; acme sent long answers (1000 in / 100 out), globex long prompts (4000 / 20)."""
    return last_week_of_traffic(gateway, served_model, gpu_type)

from tests.dataplane.gateway.conftest import (  # noqa: F401 - fixtures
    rds,
    start_emulator,
    start_gateway,
    usage_server,
    world,
)

from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    emulator_command,
    engines,
    supervisor,
)

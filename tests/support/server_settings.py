"""Settings of the servers a test starts (gunicorn): the project's own, with the tests' cheap
password hasher.

The test process hashes its users' passwords with 1,000 iterations (tests/conftest.py). A server
on the default hasher verifies such a hash, then finds its iteration count below its own
1,000,000 and hashes the password again inside the login request: about half a second of CPU,
many seconds on a loaded machine at nice 10, and a browser test's login timed out on it in CI."""

from controlplane.settings import *  # noqa: F403

PASSWORD_HASHERS = ["tests.support.hashers.FastPBKDF2PasswordHasher"]

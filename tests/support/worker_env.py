"""A pytest plugin loaded before Django's settings (`-p tests.support.worker_env`, scripts/test.sh).

Under pytest-xdist each worker has its own test database (pytest-django adds the worker id to
its name), but Redis is one server: admission buckets, throttle counts and Celery queues of two
workers would collide, since both databases number their rows from 1. So each worker takes
the Redis database below the configured one: gw0 the configured one, gw1 the next down.
"""

import os

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    _index = int(_worker[2:])
    _url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
    _base, _, _db = _url.rpartition("/")
    os.environ["REDIS_URL"] = f"{_base}/{int(_db or 0) - _index}"

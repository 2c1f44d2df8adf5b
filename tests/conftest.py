import pytest
from django.conf import settings
from django.contrib.auth.models import Group
from rest_framework.test import APIClient

from accounts import scopes as S
from accounts.models import Membership
from accounts.principals import PLANNERS_GROUP
from accounts.services import api_key_create
from tests.support import template_db
from tests.support.factories import (
    CustomerFactory,
    DeploymentFactory,
    GpuPoolFactory,
    GpuTypeFactory,
    MembershipFactory,
    ServedModelFactory,
    UserFactory,
)

# A fixture: the tests of data migrations take the database back to the newest migrations.
from tests.support.migrations import back_to_the_leaf  # noqa: F401
from tests.support.once import run_lock


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    """pytest-django's hook before it creates the test database (the worker's suffix is set):
    the database is then copied from a migrated template (tests/support/template_db.py)."""
    from django.db import connections

    template_db.install(connections["default"])


@pytest.fixture(autouse=True)
def _fresh_calibration():
    """A model's bytes per token is cached per process for a minute: no test sees the
    calibration of another's usage."""
    from capacity.metering import calibration

    calibration.forget()


@pytest.fixture(autouse=True)
def _fresh_api_throttles():
    """API throttles count in Redis across requests (accounts.throttling); every test
    starts with none counted, whatever ran before it (ids repeat after --create-db)."""
    from django.core.cache import cache

    client = cache._cache.get_client(write=True)
    stale = list(client.scan_iter(match="cp-cache:*throttle:*", count=1000))
    if stale:
        client.delete(*stale)


# Every test process hashes passwords cheaply (tests/support/hashers.py): set here, before any user
# is created.
settings.PASSWORD_HASHERS = ["tests.support.hashers.FastPBKDF2PasswordHasher"]


@pytest.fixture
def anon():
    return APIClient()


def _client_for_user(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def _client_for_key(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


@pytest.fixture
def planner(db):
    user = UserFactory(username="planner", is_staff=True)
    group, _ = Group.objects.get_or_create(name=PLANNERS_GROUP)
    user.groups.add(group)
    return user


@pytest.fixture
def planner_client(planner):
    return _client_for_user(planner)


@pytest.fixture
def acme(db):
    return CustomerFactory(slug="acme", name="Acme")


@pytest.fixture
def globex(db):
    return CustomerFactory(slug="globex", name="Globex")


@pytest.fixture
def owner(acme):
    """Owner of acme."""
    return MembershipFactory(customer=acme, role=Membership.Role.OWNER, user__username="owner").user


@pytest.fixture
def member(acme):
    """Member of acme."""
    return MembershipFactory(
        customer=acme, role=Membership.Role.MEMBER, user__username="member"
    ).user


@pytest.fixture
def outsider(globex):
    """Owner of globex: signed in, but nothing to do with acme."""
    return MembershipFactory(
        customer=globex, role=Membership.Role.OWNER, user__username="outsider"
    ).user


@pytest.fixture
def owner_client(owner):
    return _client_for_user(owner)


@pytest.fixture
def member_client(member):
    return _client_for_user(member)


@pytest.fixture
def outsider_client(outsider):
    return _client_for_user(outsider)


@pytest.fixture
def make_key(db):
    """make_key(customer=..., scopes=[...]) → (ApiKey, plaintext)."""

    def make(**kwargs):
        kwargs.setdefault("name", "test key")
        created = api_key_create(**kwargs)
        return created.api_key, created.plaintext

    return make


@pytest.fixture
def key_client():
    return _client_for_key


@pytest.fixture
def acme_key_client(make_key, acme):
    _, plaintext = make_key(customer=acme)
    return _client_for_key(plaintext)


@pytest.fixture
def globex_key_client(make_key, globex):
    _, plaintext = make_key(customer=globex)
    return _client_for_key(plaintext)


@pytest.fixture
def catalog_service_client(make_key):
    _, plaintext = make_key(service_name="provisioner", scopes=[S.READ, S.CATALOG_WRITE])
    return _client_for_key(plaintext)


@pytest.fixture
def gpu_type(db):
    return GpuTypeFactory(name="H100-80GB")


@pytest.fixture
def pool(gpu_type):
    return GpuPoolFactory(name="us-east-h100", gpu_type=gpu_type, gpu_count=8)


@pytest.fixture
def served_model(gpu_type):
    return ServedModelFactory(name="llama-8b", reference_gpu_type=gpu_type)


@pytest.fixture
def deployment(served_model, pool):
    return DeploymentFactory(
        name="llama-8b-h100", served_model=served_model, gpu_pool=pool, max_replicas=4
    )


# Replica-seconds per unit: 1 ms per input token, 20 ms per output token, 50 ms per request.
SIMPLE_WEIGHTS = {
    "input_tokens": 0.001,
    "cached_input_tokens": 0.0,
    "output_tokens": 0.02,
    "input_x_output_per_1000": 0.0,
    "output_sq_per_1000": 0.0,
    "images": 0.0,
    "request": 0.05,
}


def make_cost_model(served_model, gpu_type, *, gpus_per_replica=1, weights=None):
    from capacity.pricing.features import mu_coefficients
    from capacity.repricing.services import cost_model_record

    weights = weights or SIMPLE_WEIGHTS
    return cost_model_record(
        served_model=served_model,
        gpu_type=gpu_type,
        gpus_per_replica=gpus_per_replica,
        features=[name for name, value in weights.items() if value],
        weights_replica_seconds=weights,
        mu_per_unit=mu_coefficients(weights, 100.0),
        sample_count=10,
        distinct_shapes=10,
        cv_mape=0.02,
        cv_worst_error=0.05,
        candidates=[],
        residuals=[],
    )


@pytest.fixture
def sellable(served_model, pool, gpu_type):
    """llama-8b on 8 H100s, 1 GPU per replica: 800 MU/min deployable, 720 sellable (10 %
    headroom), priced by an active cost model."""
    DeploymentFactory(
        name="llama-8b-h100", served_model=served_model, gpu_pool=pool, max_replicas=8
    )
    cost_model = make_cost_model(served_model, gpu_type)
    served_model.headroom = 0.1
    served_model.overcommit = 1.0
    served_model.save()
    return cost_model


def pytest_collection_modifyitems(items):
    """The `slow` tests first, longest first (`slow(seconds=…)`, 30 unless told): pytest-xdist
    hands tests out in this order (two at a time, `--maxschedchunk 1` in scripts/test.sh), so a
    2-minute test started last would otherwise add its whole length to the pass. The sort is
    stable, and every worker collects the same order."""

    def longest_first(item) -> float:
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else -float(slow.kwargs.get("seconds", 30))

    items.sort(key=longest_first)


def pytest_runtest_setup(item):
    # `make test` runs the tests marked both_databases again on SQLite (`make run`'s
    # database); the few among them that need PostgreSQL itself say so.
    if item.get_closest_marker("postgresql_only"):
        from django.db import connection

        if connection.vendor != "postgresql":
            pytest.skip("needs PostgreSQL")


@pytest.fixture
def many_db_connections(tmp_path_factory):
    """For a test that holds about fifty database connections at once (one per concurrent
    client thread): one such test at a time across the run's workers, so that two of them,
    beside the other workers' connections, never meet PostgreSQL's max_connections (100 by
    default) and fail a client with "too many clients already"."""
    with run_lock(tmp_path_factory, "many-db-connections"):
        yield

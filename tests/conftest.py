import pytest
from django.contrib.auth.models import Group
from rest_framework.test import APIClient

from accounts import scopes as S
from accounts.models import Membership
from accounts.principals import PLANNERS_GROUP
from accounts.services import api_key_create
from tests.factories import (
    CustomerFactory,
    DeploymentFactory,
    GpuPoolFactory,
    GpuTypeFactory,
    MembershipFactory,
    ServedModelFactory,
    UserFactory,
)


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

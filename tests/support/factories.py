from decimal import Decimal

import factory
from django.contrib.auth import get_user_model

from accounts.models import Customer, Membership
from capacity.models import Deployment, GpuPool, GpuType, ServedModel


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("pw-for-tests-only")


class CustomerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Customer

    name = factory.Sequence(lambda n: f"Customer {n}")
    slug = factory.Sequence(lambda n: f"customer-{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    customer = factory.SubFactory(CustomerFactory)
    role = Membership.Role.MEMBER


class GpuTypeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = GpuType

    name = factory.Sequence(lambda n: f"GPU-{n}")
    memory_gb = 80
    hourly_cost_usd = Decimal("2.5000")


class GpuPoolFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = GpuPool

    name = factory.Sequence(lambda n: f"pool-{n}")
    gpu_type = factory.SubFactory(GpuTypeFactory)
    gpu_count = 8


class ServedModelFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ServedModel

    name = factory.Sequence(lambda n: f"model-{n}")
    engine_model_id = factory.LazyAttribute(lambda o: f"org/{o.name}")
    parameters_billions = 8.0
    reference_gpu_type = factory.SubFactory(GpuTypeFactory)
    context_length_tokens = 8192


class DeploymentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Deployment

    name = factory.Sequence(lambda n: f"deployment-{n}")
    served_model = factory.SubFactory(ServedModelFactory)
    gpu_pool = factory.SubFactory(GpuPoolFactory)
    gpus_per_replica = 1
    min_replicas = 0
    max_replicas = 4

"""Reads for the fleet catalog."""

from django.db.models import QuerySet

from capacity.models import Deployment, GpuPool, GpuType, ServedModel


def gpu_types() -> QuerySet[GpuType]:
    return GpuType.objects.all()


def gpu_pools() -> QuerySet[GpuPool]:
    return GpuPool.objects.select_related("gpu_type")


def served_models() -> QuerySet[ServedModel]:
    return ServedModel.objects.select_related("reference_gpu_type")


def deployments() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("served_model", "gpu_pool", "gpu_pool__gpu_type")

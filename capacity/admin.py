from django.contrib import admin

from capacity.models import Deployment, GpuPool, GpuType, ServedModel


@admin.register(GpuType)
class GpuTypeAdmin(admin.ModelAdmin):
    list_display = ["name", "memory_gb", "hourly_cost_usd"]
    search_fields = ["name"]


@admin.register(GpuPool)
class GpuPoolAdmin(admin.ModelAdmin):
    list_display = ["name", "gpu_type", "gpu_count"]
    list_filter = ["gpu_type"]
    search_fields = ["name", "gpu_type__name"]
    list_select_related = ["gpu_type"]


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "engine_model_id",
        "parameters_billions",
        "reference_gpu_type",
        "context_length_tokens",
    ]
    list_filter = ["reference_gpu_type"]
    search_fields = ["name", "engine_model_id"]
    list_select_related = ["reference_gpu_type"]


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "served_model",
        "gpu_pool",
        "gpus_per_replica",
        "min_replicas",
        "current_replicas",
        "max_replicas",
        "actuator_kind",
    ]
    list_filter = ["actuator_kind", "served_model", "gpu_pool"]
    search_fields = ["name", "served_model__name", "gpu_pool__name", "endpoint_url"]
    list_select_related = ["served_model", "gpu_pool"]

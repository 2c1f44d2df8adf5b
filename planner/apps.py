from django.apps import AppConfig


class PlannerConfig(AppConfig):
    """The capacity planner's web UI: server-rendered pages over the other apps' services."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "planner"
    verbose_name = "Planner UI"

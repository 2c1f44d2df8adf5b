from django.apps import AppConfig


class ControlPlaneConfig(AppConfig):
    # The project package is also an app so that project-wide records (the audit log) have
    # one home below every other app: accounts, capacity and billing all write to it.
    name = "controlplane"
    verbose_name = "Control plane: audit log"

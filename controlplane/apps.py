from django.apps import AppConfig


class ShellConfig(AppConfig):
    # The project's shell: settings, URLs, Celery, the WSGI/ASGI entry points and the commands
    # that span every app (seed_demo, setup_periodic_tasks). An app only so that Django finds
    # those commands; it has no models. Its label is not "controlplane", which the audit log in
    # core/ keeps.
    name = "controlplane"
    label = "shell"
    verbose_name = "Control plane: the project"

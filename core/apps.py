from django.apps import AppConfig


class CoreConfig(AppConfig):
    # The ground floor: what every app builds on (the database's locks, errors, the audit log,
    # outbound rules, settings' parsers, the API's base). Its one model, the audit log, keeps the
    # label it was created under ("controlplane": its table controlplane_auditentry, its
    # migrations and content type), from before the project's shell and this floor were split.
    name = "core"
    label = "controlplane"
    verbose_name = "Control plane: audit log"

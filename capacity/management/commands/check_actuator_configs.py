"""`manage.py check_actuator_configs`: flag every stored actuator config against today's rules.

The rules are operator settings (OUTBOUND_ALLOWED_HOSTS, ACTUATOR_SECRET_ENV_NAMES,
ACTUATOR_SECRET_DESTINATIONS, ACTUATOR_ALLOW_UNBOUND_SECRETS, ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS,
KUBERNETES_CLUSTERS). After changing them, run this: a config they now refuse (e.g. one naming
a secret for a destination it is not bound to) is flagged (`Deployment.actuator_config_problem`),
so the allocation tick stops applying it, and a flag they no longer justify is cleared. Prints
each refused config with its reason; exits 1 with --strict when any is refused.
"""

from django.core.management.base import BaseCommand, CommandError

from capacity.actuation.config import actuator_config_problem
from capacity.models import Deployment


class Command(BaseCommand):
    help = "Flag (and list) stored actuator configs that break the operator's current rules."

    def add_arguments(self, parser):
        parser.add_argument(
            "--strict", action="store_true", help="Exit with status 1 when any config is refused."
        )

    def handle(self, *args, strict=False, **options):
        refused = changed = 0
        deployments = Deployment.objects.order_by("name")
        for deployment in deployments:
            problem = actuator_config_problem(deployment.actuator_kind, deployment.actuator_config)
            if problem != deployment.actuator_config_problem:
                # Conditional on what was read, so a config written meanwhile keeps its state.
                changed += Deployment.objects.filter(
                    pk=deployment.pk,
                    actuator_config=deployment.actuator_config,
                    actuator_config_problem=deployment.actuator_config_problem,
                ).update(actuator_config_problem=problem)
                if not problem:
                    self.stdout.write(f"{deployment.name}: valid again; flag cleared")
            if problem:
                refused += 1
                self.stdout.write(f"{deployment.name} ({deployment.actuator_kind}): {problem}")
        self.stdout.write(
            f"{refused} of {deployments.count()} actuator config(s) refused; {changed} flag(s) "
            "changed."
        )
        if strict and refused:
            raise CommandError(f"{refused} actuator config(s) break the operator's rules.")

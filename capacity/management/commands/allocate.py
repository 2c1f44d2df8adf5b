import json

from django.core.management.base import BaseCommand

from capacity.allocation.tick import allocation_tick


class Command(BaseCommand):
    help = (
        "Run one allocation tick. With --dry-run, print what the next tick would do and "
        "change nothing."
    )

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument("--json", action="store_true", dest="as_json")

    def handle(self, *args, dry_run, as_json, **options):
        result = allocation_tick(dry_run=dry_run)
        if result.skipped:
            self.stderr.write("Another tick holds the lock; nothing done.")
            return
        payload = {
            "tick_id": result.tick_id,
            "dry_run": result.dry_run,
            "seconds": round(result.seconds, 4),
            "decisions": result.decisions,
            "allowances": result.allowances,
            "models": result.models,
        }
        if as_json:
            self.stdout.write(json.dumps(payload, indent=2, default=str))
            return
        verb = "would set" if dry_run else "set"
        for decision in result.decisions:
            name = decision.get("deployment") or f"deployment {decision['deployment_id']}"
            change = (
                f"{decision['current_replicas']} → {decision['target_replicas']}"
                if decision["target_replicas"] != decision["current_replicas"]
                else f"stays at {decision['current_replicas']}"
            )
            why = "; ".join(reason["message"] for reason in decision["reasons"]) or "no demand"
            self.stdout.write(f"{name}: {verb} {change} — {why}")
        for model in result.models:
            if model["guaranteed_shortfall_mu_per_minute"] > 0:
                self.stdout.write(
                    self.style.WARNING(
                        f"model {model['model_id']}: guaranteed shortfall "
                        f"{model['guaranteed_shortfall_mu_per_minute']:.1f} MU/min"
                    )
                )
        self.stdout.write(f"({len(result.decisions)} deployments in {result.seconds:.3f} s)")

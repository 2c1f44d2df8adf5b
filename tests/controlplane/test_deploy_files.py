"""The deployment files deploy/ ships run what the code needs, with no default secrets."""

import re
import secrets
from pathlib import Path

import yaml
from django.conf import settings

from tests.controlplane.test_settings import run_manage

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (error when unset or empty)."""

    def replace(match):
        name, operator, argument = match.group(1), match.group(2), match.group(3)
        given = variables.get(name, "")
        if operator == ":?" and not given:
            raise LookupError(f"{name}: {argument}")
        if operator == ":-" and not given:
            return argument
        return given

    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:[-?])([^}]*))?\}", replace, value)


def production_env_example() -> dict[str, str]:
    variables = {}
    for line in (DEPLOY / "production.env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            variables[name.strip()] = value.strip()
    return variables


def worker_queues(command: list[str]) -> set[str]:
    if "worker" not in command:
        return set()
    for position, word in enumerate(command):
        if word == "--queues":
            return set(command[position + 1].split(","))
        if word.startswith("--queues="):
            return set(word.removeprefix("--queues=").split(","))
    raise AssertionError(f"a worker with no --queues: {command}")


def test_every_celery_queue_is_consumed_by_a_compose_worker():
    services = compose()["services"]
    consumed = set().union(
        *(worker_queues(service.get("command") or []) for service in services.values())
    )
    declared = {queue.name for queue in settings.CELERY_TASK_QUEUES}
    assert declared <= consumed, f"no worker consumes {sorted(declared - consumed)}"
    assert "health" in declared


def test_compose_kubernetes_and_make_run_start_the_same_workers_on_the_same_queues():
    """controlplane/workers.py is the one home of which worker takes which queue: the tick's
    worker takes only `allocation`, so no benchmark or what-if can ever occupy it."""
    from controlplane.workers import WORKERS

    wanted = sorted(tuple(sorted(worker.queues)) for worker in WORKERS.values())
    assert ("allocation",) in wanted
    in_compose = sorted(
        tuple(sorted(queues))
        for service in compose()["services"].values()
        if (queues := worker_queues(service.get("command") or []))
    )
    assert in_compose == wanted
    manifests = (DEPLOY / "kubernetes" / "base").glob("*.yaml")
    in_kubernetes = []
    for path in manifests:
        for document in yaml.safe_load_all(path.read_text()):
            if not document or document.get("kind") != "Deployment":
                continue
            for container in document["spec"]["template"]["spec"]["containers"]:
                if queues := worker_queues(container.get("command") or []):
                    in_kubernetes.append(tuple(sorted(queues)))
    assert sorted(in_kubernetes) == wanted
    run = (Path(__file__).resolve().parents[2] / "scripts" / "run.sh").read_text()
    started = re.search(
        r"for worker in ([a-z ]+); do\n.{0,200}?python -m controlplane.workers", run, re.DOTALL
    )
    assert started and set(started.group(1).split()) == set(WORKERS)


def test_compose_has_no_default_passwords_or_secrets():
    text = (DEPLOY / "compose.yaml").read_text()
    for name in ("POSTGRES_PASSWORD", "SECRET_KEY"):
        uses = re.findall(r"\$\{" + name + r"(:[-?])?[^}]*\}", text)
        assert uses, name
        assert all(operator == ":?" for operator in uses), f"{name} has a default in compose"
    assert "controlplane@" not in text and ":controlplane}" not in text
    example = production_env_example()
    assert example["SECRET_KEY"] == "" and example["POSTGRES_PASSWORD"] == ""


def test_compose_refuses_to_start_without_the_secrets():
    app_env = compose()["x-app-env"]
    variables = production_env_example()  # blanks: as shipped
    try:
        {name: interpolate(str(value), variables) for name, value in app_env.items()}
    except LookupError as error:
        assert "POSTGRES_PASSWORD" in str(error) or "SECRET_KEY" in str(error)
    else:
        raise AssertionError("compose interpolated blank secrets")


def test_the_image_build_collects_static_files_without_a_secret():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    step = next(
        line for line in dockerfile.splitlines() if "collectstatic" in line and "RUN" in line
    )
    assert "CONTROLPLANE_BUILD_STEP=collectstatic" in step
    assert "SECRET_KEY" not in step


def test_check_deploy_passes_with_the_production_environment_deploy_ships():
    variables = production_env_example() | {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "POSTGRES_PASSWORD": secrets.token_urlsafe(32),
    }
    app_env = {
        name: interpolate(str(value), variables) for name, value in compose()["x-app-env"].items()
    }
    assert app_env["SECURE_SSL_REDIRECT"] == "1"
    result = run_manage("check", "--deploy", "--fail-level", "WARNING", **app_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout

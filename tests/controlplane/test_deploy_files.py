"""The deployment files deploy/ ships run what the code needs, with no default secrets."""

import ipaddress
import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import redis as redis_client
import yaml
from django.conf import settings

from capacity.publication import signing
from capacity.publication.redis_acl import control_plane_rules, gateway_rules
from tests.controlplane.test_settings import run_manage
from tests.support.processes import free_port

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


SECRETS = (
    "POSTGRES_PASSWORD",
    "SECRET_KEY",
    "REDIS_PASSWORD",
    "GATEWAY_REDIS_PASSWORD",
    "PUBLICATION_SIGNING_KEY",
)


def test_compose_has_no_default_passwords_or_secrets():
    text = (DEPLOY / "compose.yaml").read_text()
    for name in SECRETS:
        uses = re.findall(r"\$\{" + name + r"(:[-?])?[^}]*\}", text)
        assert uses, name
        assert all(operator == ":?" for operator in uses), f"{name} has a default in compose"
    assert "controlplane@" not in text and ":controlplane}" not in text
    example = production_env_example()
    assert all(example[name] == "" for name in SECRETS)


def test_compose_refuses_to_start_without_the_secrets():
    app_env = compose()["x-app-env"]
    variables = production_env_example()  # blanks: as shipped
    try:
        {name: interpolate(str(value), variables) for name, value in app_env.items()}
    except LookupError as error:
        assert any(name in str(error) for name in SECRETS)
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
    app_env = production_app_env()
    assert app_env["SECURE_SSL_REDIRECT"] == "1"
    result = run_manage("check", "--deploy", "--fail-level", "WARNING", **app_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def published_addresses(ports: list) -> list[str]:
    """The host address each of a service's published ports listens on: compose's short syntax
    `[HOST_IP:][HOST_PORT:]CONTAINER_PORT[/PROTOCOL]` (no HOST_IP: every interface) or the long
    one (`host_ip`)."""
    addresses = []
    for port in ports:
        if isinstance(port, dict):
            addresses.append(port.get("host_ip") or "0.0.0.0")
            continue
        text = str(port).rsplit("/", 1)[0]
        if text.startswith("["):  # [::1]:8000:8000
            addresses.append(text[1 : text.index("]")])
            continue
        parts = text.split(":")
        addresses.append(parts[0] if len(parts) == 3 else "0.0.0.0")
    return addresses


def production_app_env() -> dict[str, str]:
    """The environment compose gives the app services with production.env.example's values
    (its blank secrets filled)."""
    variables = production_variables()
    return {
        name: interpolate(str(value), variables) for name, value in compose()["x-app-env"].items()
    }


def production_variables() -> dict[str, str]:
    """production.env.example's values, its blank secrets filled as its comments say."""
    return production_env_example() | {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "POSTGRES_PASSWORD": secrets.token_urlsafe(32),
        "REDIS_PASSWORD": secrets.token_urlsafe(32),
        "GATEWAY_REDIS_PASSWORD": secrets.token_urlsafe(32),
        "PUBLICATION_SIGNING_KEY": signing.generate("k1")[0],
    }


def test_web_trusts_x_forwarded_for_only_where_nothing_but_its_proxy_can_reach_it():
    """TRUSTED_PROXY_COUNT=N makes web believe the N-th address from the right of
    X-Forwarded-For. That holds only if every request comes through those proxies: a port
    published on a public interface lets a client connect directly and write any address it
    likes, and the login lockout per address never sees the same one twice (issue 34)."""
    proxies = int(production_app_env()["TRUSTED_PROXY_COUNT"])
    addresses = published_addresses(compose()["services"]["web"].get("ports", []))
    assert addresses, "web publishes no port: nothing could reach it"
    reachable_directly = [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
    if proxies > 0:
        assert not reachable_directly, (
            f"production.env.example sets TRUSTED_PROXY_COUNT={proxies}, but compose publishes "
            f"web on {reachable_directly}: bind it to 127.0.0.1 (its proxy's side) or set 0"
        )


def test_compose_redis_answers_only_its_two_users_with_the_rules_the_code_names(tmp_path):
    """The compose Redis's command, run as compose runs it (its `$$` is compose's `$`), but with
    the ACL file in a directory of the test's own and a port of its own: the app services'
    REDIS_URL opens it as the owner, the gateway's user writes no publication, and nothing
    answers without a password (issue 34, finding 9: compose's Redis had no password)."""
    service = compose()["services"]["redis"]
    script = service["command"][2].replace("$$", "$")
    assert f'{control_plane_rules()}"' in script and f'{gateway_rules()}"' in script
    variables = production_variables()
    port = free_port()
    acl = tmp_path / "users.acl"
    script = script.replace("/tmp/users.acl", str(acl))
    script = script.replace("chown redis", "chmod 600")  # no `redis` user on this machine
    script = script.replace(
        "exec docker-entrypoint.sh redis-server --appendonly yes",
        f"exec redis-server --port {port} --save '' --dir {tmp_path}",
    )
    environment = {
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        **{name: interpolate(value, variables) for name, value in service["environment"].items()},
    }
    process = subprocess.Popen(["sh", "-c", script], env=environment, stdout=subprocess.DEVNULL)
    try:
        app_url = production_app_env()["REDIS_URL"]
        app_url = app_url.replace("@redis:6379", f"@127.0.0.1:{port}")
        # The app's URL carries the password compose interpolated from the same variable.
        app_url = re.sub(
            r"controlplane:[^@]*@", f"controlplane:{variables['REDIS_PASSWORD']}@", app_url
        )
        owner = redis_client.Redis.from_url(app_url)
        for _ in range(200):
            try:
                owner.ping()
                break
            except redis_client.ConnectionError:
                time.sleep(0.05)
        assert oct(acl.stat().st_mode & 0o777) == "0o600"
        owner.hset("gw:v1:keys", "mu0000000000", "{}")
        with pytest.raises(redis_client.AuthenticationError):
            redis_client.Redis(port=port).ping()  # no password: the default user is off
        gateway = redis_client.Redis(
            port=port, username="gateway", password=variables["GATEWAY_REDIS_PASSWORD"]
        )
        assert gateway.hgetall("gw:v1:keys") == {b"mu0000000000": b"{}"}
        with pytest.raises(redis_client.exceptions.NoPermissionError):
            gateway.hset("gw:v1:keys", "mu0000forged", "{}")
    finally:
        process.terminate()
        process.wait(timeout=10)

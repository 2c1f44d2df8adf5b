"""Engine processes on one GPU host, kept at the replica count the control plane asks for.

The allocation tick runs in short-lived Celery tasks, but an engine must outlive a tick, so
the processes belong to this long-running supervisor on the GPU host (`python -m
dataplane.supervisor`), which the process actuator calls over HTTP. Each scale request
carries the deployment's parameters, so the supervisor needs no database; it is plain Python
(subprocess and threads) and imports nothing from Django.

The supervisor runs only its own engines: an allow-list of named argv templates given at its
start (`--engine NAME='argv…'`, `--engines FILE`). A scale request names an engine and never
carries a command, so whoever can call the API chooses among the operator's commands only.
Per deployment, replica i runs its engine's argv with "{port}" = base_port + i, "{replica}"
= i and "{host}" = host substituted, in its own session (process group), so that a signal
reaches an engine's worker processes too and the supervisor's Ctrl-C reaches no engine.

- A monitor thread restarts a replica that exits without being asked to, after a backoff
  that doubles per consecutive crash; `restarts` counts those restarts.
- A replica is ready once `GET http://host:port/health` answers 200.
- Scaling down removes the highest-numbered replicas, so the ports in use stay consecutive.
  A removed replica drains: the supervisor polls its `/metrics` until vLLM's
  `num_requests_running + num_requests_waiting` is 0 (or `drain_seconds` pass), then sends
  SIGTERM, waits (at least `term_grace_seconds`), then SIGKILL. Engines do not drain by
  themselves: on SIGTERM vLLM, like the emulator, stops within seconds and cuts what is
  running, which is why the wait comes before the signal.
- Draining runs on its own thread per replica, so a scale call answers at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

MAX_REPLICAS = 1024
MAX_DRAIN_SECONDS = 3600.0
DEFAULT_DRAIN_SECONDS = 30.0

STARTING = "starting"
READY = "ready"
DRAINING = "draining"
CRASHED = "crashed"

# Names go into log file names, so no path separators.
_DEPLOYMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
# The same rule as the process actuator's `engine` (capacity/actuation/config.py).
ENGINE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# A host name or an IP address: it is substituted into engines' argv as "{host}", so nothing
# that could read as an option or a second word.
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:%_-]{0,252}$")
_IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class SpecError(ValueError):
    """A scale request the supervisor will not carry out: a bad field or a port clash."""


class SupervisorClosed(RuntimeError):
    """The supervisor is shutting down and starts nothing more."""


class _NoInFlightMetrics(Exception):
    """The engine serves no vLLM request gauges, so its in-flight count cannot be known."""


def parse_engines(
    engine_options: list[str] | tuple[str, ...] = (), engines_file: str | Path | None = None
) -> dict[str, tuple[str, ...]]:
    """The allow-list {name: argv template} from `NAME=argv…` options (shlex-split) and a JSON
    file {name: [argv…] or "argv…"}; ValueError naming the engine at fault."""
    entries: list[tuple[str, object, str]] = []
    for option in engine_options:
        name, sep, template = option.partition("=")
        if not sep:
            raise ValueError(f"--engine {option!r}: expected NAME='argv with {{port}}'.")
        try:
            argv = shlex.split(template)
        except ValueError as error:
            raise ValueError(f"--engine {name}: {error}") from None
        entries.append((name.strip(), argv, "--engine"))
    if engines_file is not None:
        try:
            loaded = json.loads(Path(engines_file).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"--engines {engines_file}: {error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--engines {engines_file}: must be a JSON object {{name: argv}}.")
        for name, argv in loaded.items():
            if isinstance(argv, str):
                argv = shlex.split(argv)
            entries.append((name, argv, f"--engines {engines_file}"))
    engines: dict[str, tuple[str, ...]] = {}
    for name, command, where in entries:
        if not isinstance(name, str) or not ENGINE_NAME.match(name):
            raise ValueError(f"{where}: engine name {name!r} must match {ENGINE_NAME.pattern}.")
        if name in engines:
            raise ValueError(f"{where}: engine {name!r} is given twice.")
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(a, str) and a for a in command)
        ):
            raise ValueError(f"{where}: engine {name!r} must be a non-empty argv.")
        # Without the placeholder every replica would try the same port and all but one crash.
        if not any("{port}" in arg for arg in command):
            raise ValueError(f'{where}: engine {name!r} must contain "{{port}}" in one argument.')
        engines[name] = tuple(command)
    return engines


@dataclass(frozen=True)
class DeploymentSpec:
    """What a scale request asks for: an engine of the allow-list, and where it listens."""

    engine: str
    host: str = "127.0.0.1"
    base_port: int = 8000
    drain_seconds: float = DEFAULT_DRAIN_SECONDS

    def argv(self, template: tuple[str, ...], replica_index: int) -> list[str]:
        port = self.base_port + replica_index
        # Plain replacement, not str.format: engine arguments may hold JSON, braces and all.
        return [
            arg.replace("{port}", str(port))
            .replace("{replica}", str(replica_index))
            .replace("{host}", self.host)
            for arg in template
        ]

    def runs_same_processes_as(self, other: DeploymentSpec) -> bool:
        """Whether a replica started from `other` is a replica of this spec (drain time aside)."""
        return (self.engine, self.host, self.base_port) == (
            other.engine,
            other.host,
            other.base_port,
        )


def parse_scale_request(body: object) -> tuple[str, int, DeploymentSpec]:
    """(deployment, replicas, spec) from a `POST /scale` body, or SpecError naming the field.

    Whether the engine is one of this supervisor's is checked by `ProcessSupervisor.scale`.
    """
    if not isinstance(body, dict):
        raise SpecError("the body must be a JSON object.")
    if "command" in body:
        raise SpecError(
            "command: this supervisor runs only the engines of its own allow-list "
            "(python -m dataplane.supervisor --engine NAME=...); name one in 'engine'."
        )
    known = {"deployment", "replicas", "engine", "host", "base_port", "drain_seconds"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise SpecError(f"unknown field(s): {', '.join(unknown)}.")
    name = body.get("deployment")
    if not isinstance(name, str) or not _DEPLOYMENT_NAME.match(name):
        raise SpecError("deployment: must be 1-100 letters, digits, '.', '_' or '-'.")
    replicas = _integer(body, "replicas", 0, MAX_REPLICAS)
    engine = body.get("engine")
    if not isinstance(engine, str) or not ENGINE_NAME.match(engine):
        raise SpecError(f"engine: must be an engine name ({ENGINE_NAME.pattern}).")
    host = body.get("host", "127.0.0.1")
    if not isinstance(host, str) or not _HOST.match(host):
        raise SpecError("host: must be a host name or an IP address.")
    base_port = _integer(body, "base_port", 1, 65535)
    if base_port + max(replicas, 1) - 1 > 65535:
        raise SpecError(f"base_port: {replicas} replicas from port {base_port} pass 65535.")
    drain_seconds = body.get("drain_seconds", DEFAULT_DRAIN_SECONDS)
    if (
        not isinstance(drain_seconds, int | float)
        or isinstance(drain_seconds, bool)
        or not 0 <= drain_seconds <= MAX_DRAIN_SECONDS
    ):
        raise SpecError(f"drain_seconds: must be a number from 0 to {MAX_DRAIN_SECONDS:g}.")
    return name, replicas, DeploymentSpec(engine, host, base_port, float(drain_seconds))


def _integer(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SpecError(f"{key}: must be an integer from {low} to {high}.")
    return value


class ReplicaStatus(TypedDict):
    replica: int
    port: int
    pid: int | None
    state: str
    restarts: int
    last_error: str


class DeploymentStatus(TypedDict):
    deployment: str
    target: int
    ready: int
    engine: str
    host: str
    base_port: int
    drain_seconds: float
    replicas: list[ReplicaStatus]


class SupervisorStatus(TypedDict):
    deployments: dict[str, DeploymentStatus]


@dataclass(eq=False)
class _Replica:
    deployment: str
    index: int
    spec: DeploymentSpec
    state: str = STARTING
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    consecutive_crashes: int = 0
    next_start_monotonic: float = 0.0
    ready_since_monotonic: float | None = None
    last_error: str = ""
    # Draining: a drain thread and a scale-up that reclaims the replica race for it under the
    # supervisor's lock. Each retirement gets a new generation and a reclaim bumps it, so a
    # drain thread whose generation is stale knows the replica is no longer its to stop.
    drain_deadline_monotonic: float = 0.0
    drain_generation: int = 0
    term_sent: bool = False

    @property
    def port(self) -> int:
        return self.spec.base_port + self.index

    def status(self) -> ReplicaStatus:
        return {
            "replica": self.index,
            "port": self.port,
            "pid": self.process.pid if self.process is not None else None,
            "state": self.state,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }


@dataclass(eq=False)
class _Deployment:
    name: str
    spec: DeploymentSpec
    target: int = 0
    active: dict[int, _Replica] = field(default_factory=dict)
    retiring: list[_Replica] = field(default_factory=list)


class ProcessSupervisor:
    """Keeps each deployment's replicas running; thread-safe; `start()` before use.

    `engines`: the allow-list {name: argv template} (see `parse_engines`); nothing else runs.
    `log_dir`: each replica's stdout and stderr go to `<log_dir>/<deployment>-<i>.log`
    (appended across restarts); without it they go to the supervisor's own.
    """

    def __init__(
        self,
        *,
        engines: dict[str, tuple[str, ...]],
        log_dir: Path | str | None = None,
        monitor_interval_seconds: float = 0.5,
        health_timeout_seconds: float = 1.0,
        restart_backoff_seconds: float = 1.0,
        max_restart_backoff_seconds: float = 30.0,
        stable_after_seconds: float = 60.0,
        term_grace_seconds: float = 10.0,
        drain_poll_seconds: float = 0.5,
    ) -> None:
        self.engines = {name: tuple(argv) for name, argv in engines.items()}
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.monitor_interval_seconds = monitor_interval_seconds
        self.health_timeout_seconds = health_timeout_seconds
        self.restart_backoff_seconds = restart_backoff_seconds
        self.max_restart_backoff_seconds = max_restart_backoff_seconds
        self.stable_after_seconds = stable_after_seconds
        self.term_grace_seconds = term_grace_seconds
        self.drain_poll_seconds = drain_poll_seconds
        self._lock = threading.Lock()
        self._deployments: dict[str, _Deployment] = {}
        self._drain_threads: list[threading.Thread] = []
        self._closing = False
        self._stop_monitor = threading.Event()
        # Set by a second Ctrl-C: drains stop waiting for requests and go straight to SIGTERM.
        self._hurry = threading.Event()
        self._monitor: threading.Thread | None = None
        # Engines are local or on the LAN: a proxy from the environment would only get in the way.
        self._http = httpx.Client(timeout=health_timeout_seconds, trust_env=False)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> ProcessSupervisor:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._monitor = threading.Thread(
            target=self._monitor_loop, name="process-supervisor-monitor", daemon=True
        )
        self._monitor.start()
        return self

    def __enter__(self) -> ProcessSupervisor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(drain=False)

    def hurry(self) -> None:
        """Stop waiting for in-flight requests: every drain goes on to SIGTERM now."""
        self._hurry.set()

    def shutdown(self, *, drain: bool = True) -> None:
        """Stop every replica (draining them first unless `drain` is False) and the monitor."""
        with self._lock:
            self._closing = True
            if not drain:
                self._hurry.set()
            for deployment in self._deployments.values():
                deployment.target = 0
                for index in sorted(deployment.active, reverse=True):
                    self._retire_locked(deployment, deployment.active.pop(index))
            threads = list(self._drain_threads)
        for thread in threads:
            # Joined in slices so the main thread still handles a second Ctrl-C meanwhile.
            while thread.is_alive():
                thread.join(0.2)
        self._stop_monitor.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
        self._http.close()

    # -- the API --------------------------------------------------------------------------

    def scale(self, name: str, replicas: int, spec: DeploymentSpec) -> DeploymentStatus:
        """Set `name` to `replicas` replicas of `spec`; answer at once with its status.

        A changed engine, host or base port replaces every replica (the old ones drain; a
        new one starts when its port is free); a changed drain time applies from now on.
        """
        if not 0 <= replicas <= MAX_REPLICAS:
            raise SpecError(f"replicas: must be from 0 to {MAX_REPLICAS}.")
        if spec.engine not in self.engines:
            raise SpecError(
                f"engine: '{spec.engine}' is not an engine of this supervisor (known: "
                f"{', '.join(sorted(self.engines)) or 'none; start it with --engine'})."
            )
        with self._lock:
            if self._closing:
                raise SupervisorClosed("the process supervisor is shutting down.")
            self._check_ports_locked(name, replicas, spec)
            deployment = self._deployments.get(name)
            if deployment is None:
                deployment = self._deployments[name] = _Deployment(name, spec)
            elif not deployment.spec.runs_same_processes_as(spec):
                logger.info("%s: engine, host or base port changed; replacing replicas", name)
                for index in sorted(deployment.active, reverse=True):
                    self._retire_locked(deployment, deployment.active.pop(index))
            deployment.spec = spec
            deployment.target = replicas
            # Highest-numbered first, so the remaining ports are base_port .. base_port+n-1.
            for index in sorted(deployment.active, reverse=True):
                if index >= replicas:
                    self._retire_locked(deployment, deployment.active.pop(index))
            for index in range(replicas):
                if index in deployment.active:
                    deployment.active[index].spec = spec
                    continue
                replica = self._reclaim_locked(deployment, index)
                deployment.active[index] = replica or _Replica(name, index, spec)
            self._spawn_due_locked(time.monotonic())
            return self._deployment_status_locked(deployment)

    def restart(self, name: str, index: int) -> ReplicaStatus:
        """Kill replica `index` of `name` at once (a hung engine ignores SIGTERM's polite
        request) and start it again; answers the replica's status."""
        with self._lock:
            if self._closing:
                raise SupervisorClosed("the process supervisor is shutting down.")
            deployment = self._deployments.get(name)
            replica = deployment.active.get(index) if deployment is not None else None
            if replica is None:
                raise LookupError(f"no running replica {index} of deployment {name!r}.")
            process = replica.process
            if process is not None:
                _signal_group(process, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
            replica.process = None
            replica.ready_since_monotonic = None
            replica.last_error = "restarted on request (health probes failed)"
            replica.consecutive_crashes = 0
            replica.next_start_monotonic = 0.0
            replica.state = STARTING
            replica.restarts += 1
            logger.warning("%s[%d]: restarting on request", name, index)
            self._spawn_locked(replica, time.monotonic())
            return replica.status()

    def status(self) -> SupervisorStatus:
        """Per deployment: target, ready count, and each replica's pid, port, state, restarts."""
        with self._lock:
            return {
                "deployments": {
                    name: self._deployment_status_locked(deployment)
                    for name, deployment in sorted(self._deployments.items())
                }
            }

    def deployment_status(self, name: str) -> DeploymentStatus | None:
        with self._lock:
            deployment = self._deployments.get(name)
            return None if deployment is None else self._deployment_status_locked(deployment)

    # -- bookkeeping (callers hold the lock) -----------------------------------------------

    def _deployment_status_locked(self, deployment: _Deployment) -> DeploymentStatus:
        now = time.monotonic()
        for replica in deployment.active.values():
            # A dead process is never reported ready, even between two monitor passes.
            self._reap_locked(replica, now)
        replicas = [deployment.active[index] for index in sorted(deployment.active)]
        replicas += sorted(deployment.retiring, key=lambda replica: replica.index)
        return {
            "deployment": deployment.name,
            "target": deployment.target,
            "ready": sum(replica.state == READY for replica in deployment.active.values()),
            "engine": deployment.spec.engine,
            "host": deployment.spec.host,
            "base_port": deployment.spec.base_port,
            "drain_seconds": deployment.spec.drain_seconds,
            "replicas": [replica.status() for replica in replicas],
        }

    def _check_ports_locked(self, name: str, replicas: int, spec: DeploymentSpec) -> None:
        wanted = {(spec.host, spec.base_port + index) for index in range(replicas)}
        for other in self._deployments.values():
            if other.name == name:
                continue
            taken = {(r.spec.host, r.port) for r in [*other.active.values(), *other.retiring]}
            clash = sorted(port for _, port in wanted & taken)
            if clash:
                raise SpecError(
                    f"base_port: port {clash[0]} on {spec.host} belongs to deployment "
                    f"'{other.name}'; give '{name}' a range of its own."
                )

    def _reclaim_locked(self, deployment: _Deployment, index: int) -> _Replica | None:
        """A draining replica `index` that has not had SIGTERM yet serves again as it is."""
        for replica in deployment.retiring:
            if (
                replica.index == index
                and not replica.term_sent
                and replica.spec.runs_same_processes_as(deployment.spec)
                and replica.process is not None
                and replica.process.poll() is None
            ):
                replica.drain_generation += 1
                deployment.retiring.remove(replica)
                replica.spec = deployment.spec
                replica.state = READY if replica.ready_since_monotonic is not None else STARTING
                logger.info("%s[%d]: scaled up again while draining; kept", deployment.name, index)
                return replica
        return None

    def _retire_locked(self, deployment: _Deployment, replica: _Replica) -> None:
        process = replica.process
        if process is None or process.poll() is not None:
            if process is not None:
                _signal_group(process, signal.SIGKILL)  # leftovers of an engine that died
            return
        replica.state = DRAINING
        replica.drain_generation += 1
        replica.drain_deadline_monotonic = time.monotonic() + deployment.spec.drain_seconds
        deployment.retiring.append(replica)
        logger.info(
            "%s[%d]: draining pid %d on port %d (up to %gs)",
            deployment.name,
            replica.index,
            process.pid,
            replica.port,
            deployment.spec.drain_seconds,
        )
        self._drain_threads = [thread for thread in self._drain_threads if thread.is_alive()]
        thread = threading.Thread(
            target=self._drain,
            args=(deployment, replica, process, replica.drain_generation),
            name=f"drain-{deployment.name}-{replica.index}",
            daemon=True,
        )
        self._drain_threads.append(thread)
        thread.start()

    def _reap_locked(self, replica: _Replica, now: float) -> None:
        process = replica.process
        if process is None or process.poll() is None:
            return
        replica.last_error = _describe_exit(process.returncode)
        _signal_group(process, signal.SIGKILL)  # workers an engine left behind hold the GPU
        replica.process = None
        replica.ready_since_monotonic = None
        self._crashed_locked(replica, now)

    def _crashed_locked(self, replica: _Replica, now: float) -> None:
        replica.state = CRASHED
        replica.consecutive_crashes += 1
        backoff_seconds = min(
            self.max_restart_backoff_seconds,
            self.restart_backoff_seconds * 2 ** (replica.consecutive_crashes - 1),
        )
        replica.next_start_monotonic = now + backoff_seconds
        logger.warning(
            "%s[%d]: %s; restarting in %gs",
            replica.deployment,
            replica.index,
            replica.last_error,
            backoff_seconds,
        )

    def _spawn_due_locked(self, now: float) -> None:
        # A port is free only once the replica that drains on it has exited.
        draining_ports = {
            (replica.spec.host, replica.port)
            for deployment in self._deployments.values()
            for replica in deployment.retiring
        }
        for deployment in self._deployments.values():
            for replica in deployment.active.values():
                if replica.process is not None or now < replica.next_start_monotonic:
                    continue
                if (replica.spec.host, replica.port) in draining_ports:
                    replica.state = STARTING
                    continue
                self._spawn_locked(replica, now)

    def _spawn_locked(self, replica: _Replica, now: float) -> None:
        is_restart = replica.state == CRASHED
        if _port_answers(replica.spec.host, replica.port):
            # Typically an engine orphaned by an earlier supervisor; starting another would
            # only crash on bind, so say what is wrong instead.
            replica.last_error = f"port {replica.port} is already in use by another process"
            self._crashed_locked(replica, now)
            return
        argv = replica.spec.argv(self.engines[replica.spec.engine], replica.index)
        log_file = None
        try:
            if self.log_dir is not None:
                log_path = self.log_dir / f"{replica.deployment}-{replica.index}.log"
                log_file = open(log_path, "ab")  # noqa: SIM115 - the child keeps its own copy
            # The argv is an engine of the operator's allow-list, by design (S603).
            replica.process = subprocess.Popen(  # noqa: S603
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT if log_file is not None else None,
                # A process group of its own (signalled whole: the engine and its workers),
                # in the supervisor's session: Linux's autogroup scheduling shares the CPU
                # equally between sessions, so an engine in a new session would escape the
                # priority (nice) the operator gave the supervisor.
                process_group=0,
            )
        except OSError as error:
            replica.last_error = f"cannot start {argv[0]!r}: {error}"
            self._crashed_locked(replica, now)
            return
        finally:
            if log_file is not None:
                log_file.close()
        if is_restart:
            replica.restarts += 1
        replica.state = STARTING
        replica.ready_since_monotonic = None
        logger.info(
            "%s[%d]: started pid %d on port %d%s",
            replica.deployment,
            replica.index,
            replica.process.pid,
            replica.port,
            f" (restart {replica.restarts})" if is_restart else "",
        )

    # -- the monitor ----------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self._stop_monitor.wait(self.monitor_interval_seconds):
            try:
                self._monitor_pass()
            except Exception:  # one bad pass must not end supervision
                logger.exception("process supervisor: monitor pass failed")

    def _monitor_pass(self) -> None:
        now = time.monotonic()
        with self._lock:
            for deployment in self._deployments.values():
                for replica in deployment.active.values():
                    self._reap_locked(replica, now)
                    if (
                        replica.state == READY
                        and replica.ready_since_monotonic is not None
                        and now - replica.ready_since_monotonic >= self.stable_after_seconds
                    ):
                        replica.consecutive_crashes = 0
            if not self._closing:
                self._spawn_due_locked(now)
            starting = [
                (deployment, replica, replica.process)
                for deployment in self._deployments.values()
                for replica in deployment.active.values()
                if replica.state == STARTING and replica.process is not None
            ]
        # Health checks without the lock: a slow engine must not stall scale calls.
        for deployment, replica, process in starting:
            if not self._healthy(replica):
                continue
            with self._lock:
                if (
                    replica.process is process
                    and replica.state == STARTING
                    and deployment.active.get(replica.index) is replica
                    and process.poll() is None
                ):
                    replica.state = READY
                    replica.ready_since_monotonic = time.monotonic()
                    logger.info(
                        "%s[%d]: ready on port %d", deployment.name, replica.index, replica.port
                    )

    def _healthy(self, replica: _Replica) -> bool:
        try:
            url = f"http://{_host_for_url(replica.spec.host)}:{replica.port}/health"
            response = self._http.get(url)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    # -- draining -------------------------------------------------------------------------

    def _drain(
        self,
        deployment: _Deployment,
        replica: _Replica,
        process: subprocess.Popen[bytes],
        generation: int,
    ) -> None:
        try:
            self._wait_for_idle(replica, process, generation)
            with self._lock:
                if replica.drain_generation != generation:
                    return  # scaled up again meanwhile: the replica serves on
                replica.term_sent = True
            self._stop(replica, process)
        except Exception:  # the replica must still go, and SIGKILL always works
            logger.exception("%s[%d]: drain failed; killing", deployment.name, replica.index)
            _signal_group(process, signal.SIGKILL)
            process.wait()
        with self._lock:
            if replica in deployment.retiring:
                deployment.retiring.remove(replica)
            # A replica waiting for this port can start now rather than at the next pass.
            if not self._closing:
                self._spawn_due_locked(time.monotonic())

    def _wait_for_idle(
        self, replica: _Replica, process: subprocess.Popen[bytes], generation: int
    ) -> None:
        """Until the replica has no request in flight, the drain time is up, or it exited."""
        if replica.ready_since_monotonic is None:
            return  # it never served, so it has nothing to finish
        while not self._hurry.is_set():
            with self._lock:
                if replica.drain_generation != generation:
                    return
            if process.poll() is not None:
                return
            try:
                in_flight = self._in_flight(replica)
            except _NoInFlightMetrics:
                # Its own SIGTERM handling and the rest of the drain time are all there is.
                return
            if in_flight == 0:
                return
            remaining_seconds = replica.drain_deadline_monotonic - time.monotonic()
            if remaining_seconds <= 0:
                logger.warning(
                    "%s[%d]: drain time up with %s request(s) in flight",
                    replica.deployment,
                    replica.index,
                    "an unknown number of" if in_flight is None else in_flight,
                )
                return
            self._hurry.wait(min(self.drain_poll_seconds, remaining_seconds))

    def _in_flight(self, replica: _Replica) -> int | None:
        """Running + waiting requests from vLLM's gauges; None while the engine does not answer.

        Raises _NoInFlightMetrics when it answers without them (not a vLLM-like engine).
        """
        url = f"http://{_host_for_url(replica.spec.host)}:{replica.port}/metrics"
        try:
            response = self._http.get(url)
        except httpx.HTTPError:
            return None  # a busy engine may answer late; ask again
        if response.status_code == 404:
            raise _NoInFlightMetrics
        if response.status_code != 200:
            return None
        try:
            samples = [
                sample.value
                for family in text_string_to_metric_families(response.text)
                if family.name in _IN_FLIGHT_METRICS
                for sample in family.samples
            ]
        except ValueError:
            return None
        if not samples:
            raise _NoInFlightMetrics
        return round(sum(samples))

    def _stop(self, replica: _Replica, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM, wait for the rest of the drain time (at least the grace), then SIGKILL."""
        term_sent_at = time.monotonic()
        logger.info("%s[%d]: SIGTERM to pid %d", replica.deployment, replica.index, process.pid)
        _signal_group(process, signal.SIGTERM)
        patient_deadline = max(
            replica.drain_deadline_monotonic, term_sent_at + self.term_grace_seconds
        )
        while process.poll() is None:
            deadline = (
                term_sent_at + self.term_grace_seconds if self._hurry.is_set() else patient_deadline
            )
            if time.monotonic() >= deadline:
                logger.warning(
                    "%s[%d]: pid %d ignored SIGTERM; SIGKILL",
                    replica.deployment,
                    replica.index,
                    process.pid,
                )
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)
        # Also reaches workers that outlived their parent, whatever the parent did.
        _signal_group(process, signal.SIGKILL)
        process.wait()
        logger.info(
            "%s[%d]: stopped (%s)",
            replica.deployment,
            replica.index,
            _describe_exit(process.returncode),
        )


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    # process_group=0 made the engine its group's leader, so its pid is the group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(process.pid, signum)


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False

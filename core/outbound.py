"""What the control plane may reach, and with which credentials: the operator's, never the API's.

Secrets, commands, file paths and reachable hosts are operator settings (docs/design.md#trust).
The API only chooses among what the operator allowed, and this module is the one home of the
rules:

- **Reachable hosts** (`OUTBOUND_ALLOWED_HOSTS` for actuators, probes and restarts;
  `BENCHMARK_ALLOWED_HOSTS` for benchmark load): CIDRs, IP addresses and host names (exact,
  or `*.suffix`). `check_url` refuses a URL at write time with a DomainError naming the rule;
  `client()` / `async_client()` check again at connect time, on the *resolved* address, and
  connect to the address they checked, so a name that resolves elsewhere later (DNS rebinding)
  gains nothing. They follow no redirect and read no proxy from the environment (a proxy
  would connect on our behalf, unchecked). `aiohttp_session()` is the same guard for aiohttp
  (the load runner), vetting each address where its socket is made.
- **Link-local and cloud-metadata addresses** (169.254.0.0/16, fe80::/10, 100.100.100.200,
  fd00:ec2::254) hold instance credentials; they are refused even when a broad entry such as
  0.0.0.0/0 covers them, and opened only by an entry that lies inside those ranges.
- **Secrets by name** (`ACTUATOR_SECRET_ENV_NAMES`): which environment variables a config's
  `token_env` / `secret_env` may name; never the control plane's own secrets, whatever the
  setting says.
- **Secrets bound to their destinations** (`ACTUATOR_SECRET_DESTINATIONS`, issue 34): a name
  may be sent only to the destinations the operator bound it to, of one kind (a process
  supervisor's bearer token, a webhook's signing secret), by host and port; a cluster
  profile's `token_env` is bound to that profile. Allowing a host is not allowing a secret to
  go there: without bindings, whoever may write a config could send a supervisor's token to a
  listener of their own on any allowed host. A name bound nowhere goes nowhere unless
  `ACTUATOR_ALLOW_UNBOUND_SECRETS` is on. Checked when a config is written and again by
  `actuator_secret()`, the one place actuators, probes and restarts read a secret.
- **Kubernetes clusters** (`KUBERNETES_CLUSTERS`): named profiles (kubeconfig file, API server
  and token, or in-cluster) that a config picks by name.

The policy objects are plain Python (no Django): settings.py parses the environment with them
at start-up, and the load runner uses them without Django. Only `policy()`,
`secret_env_refusal_from_settings()` and the secret bindings' `*_from_settings()` /
`actuator_secret()` read django.conf.settings.
"""

from __future__ import annotations

import errno
import fnmatch
import ipaddress
import json
import os
import re
import socket
import ssl
import typing
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import anyio
import httpcore
import httpx
from django.conf import settings

from core.errors import DomainError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# --- Settings' names and defaults -------------------------------------------------------------

OUTBOUND = "outbound"
BENCHMARK = "benchmark"
SETTING_FOR_PURPOSE = {OUTBOUND: "OUTBOUND_ALLOWED_HOSTS", BENCHMARK: "BENCHMARK_ALLOWED_HOSTS"}
# Everything in the demo and the tests listens on this machine.
# Typed: the settings read these while this module is still being imported (it imports the
# settings back), where a type checker cannot infer them.
DEFAULT_ALLOWED_HOSTS: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "localhost")
DEFAULT_SECRET_ENV_NAMES: tuple[str, ...] = ("MU_ACTUATOR_*",)
DEFAULT_KUBERNETES_CLUSTERS: dict[str, dict[str, object]] = {"in-cluster": {"in_cluster": True}}

# Instance-metadata services answer on these with the machine's cloud credentials; link-local
# ranges hold them on every major cloud (AWS, GCP, Azure, OCI on 169.254.169.254, AWS over
# IPv6 on fd00:ec2::254, Alibaba on 100.100.100.200). 64:ff9b::/96 is NAT64's view of IPv4.
METADATA_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(text)
    for text in (
        "169.254.0.0/16",
        "fe80::/10",
        "100.100.100.200/32",
        "fd00:ec2::254/128",
        "64:ff9b::a9fe:0/112",
    )
)

# --- Reachable hosts --------------------------------------------------------------------------

_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def _address(text: str) -> IPAddress | None:
    """The IP address `text` spells (brackets allowed), IPv4-mapped IPv6 as IPv4; else None."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _within(address: IPAddress, networks: typing.Iterable[IPNetwork]) -> bool:
    return any(address.version == net.version and address in net for net in networks)


class OutboundRefused(httpx.ConnectError):
    """A connection the policy refuses; raised by the guarded clients before any packet is sent.

    A subclass of httpx.ConnectError, so callers that already handle a failed connection
    handle this one; check for it first where a refusal must not be retried.
    """

    def __init__(self, message: str, *, host: str, address: str, setting: str) -> None:
        super().__init__(message)
        self.host = host
        self.address = address
        self.setting = setting


class Unresolvable(Exception):
    """A host name that getaddrinfo cannot resolve."""


@dataclass(frozen=True)
class HostPolicy:
    """One allow-list of hosts, parsed from the setting named `setting`."""

    setting: str
    entries: tuple[str, ...]
    networks: tuple[IPNetwork, ...]
    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com" for "*.example.com"
    # The entries that lie inside a metadata range: only these open metadata addresses.
    metadata_openers: tuple[IPNetwork, ...]

    @classmethod
    def parse(cls, setting: str, entries: typing.Iterable[str]) -> HostPolicy:
        """Raises ValueError naming the entry that is neither a CIDR, an address nor a name."""
        kept, networks, names, suffixes = [], [], set(), []
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            kept.append(entry)
            if "/" in entry:
                try:
                    # strict: 10.0.0.1/8 is probably a typo for 10.0.0.1 or 10.0.0.0/8.
                    networks.append(ipaddress.ip_network(entry.strip("[]"), strict=True))
                except ValueError as error:
                    raise ValueError(
                        f"{entry!r} is not a CIDR such as 10.0.0.0/8: {error}"
                    ) from None
                continue
            address = _address(entry)
            if address is not None:
                networks.append(ipaddress.ip_network(address))
                continue
            name = entry.lower().rstrip(".")
            if name.startswith("*."):
                if not _HOST_NAME.match(name[2:]):
                    raise ValueError(f"{entry!r} is not a host-name wildcard such as *.svc.local.")
                suffixes.append(name[1:])
                continue
            if not _HOST_NAME.match(name):
                raise ValueError(
                    f"{entry!r} is not a CIDR, an IP address or a host name (exact, or *.suffix)."
                )
            names.add(name)
        openers = tuple(
            net
            for net in networks
            if any(net.version == m.version and net.subnet_of(m) for m in METADATA_NETWORKS)
        )
        return cls(
            setting, tuple(kept), tuple(networks), frozenset(names), tuple(suffixes), openers
        )

    def describe(self) -> str:
        """The setting as a refusal quotes it, so the operator sees what to change."""
        return f"{self.setting}={','.join(self.entries) or '(empty)'}"

    def allows_name(self, host: str) -> bool:
        """Whether the host name itself is listed (exactly, or under a `*.suffix`)."""
        name = host.lower().rstrip(".")
        return name in self.names or any(name.endswith(suffix) for suffix in self.suffixes)

    def address_refusal(self, address: IPAddress, *, allowed_by_name: bool = False) -> str:
        """Why connecting to `address` is refused, or "" when it is allowed."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if _within(address, METADATA_NETWORKS):
            if _within(address, self.metadata_openers):
                return ""
            return (
                f"{address} is a link-local or cloud-metadata address, refused unless an entry of "
                f"{self.setting} lies inside that range (e.g. {address}/"
                f"{address.max_prefixlen}); a broad entry such as 0.0.0.0/0 does not open it"
            )
        if allowed_by_name or _within(address, self.networks):
            return ""
        return f"{address} is not in {self.describe()}"

    def vet(self, host: str, addresses: typing.Iterable[IPAddress], *, allowed_by_name: bool):
        """`addresses` when every one is allowed; else OutboundRefused for the first refused."""
        vetted = []
        for address in addresses:
            refusal = self.address_refusal(address, allowed_by_name=allowed_by_name)
            if refusal:
                raise OutboundRefused(
                    f"refused to connect to {host}: {refusal} (an operator setting).",
                    host=host,
                    address=str(address),
                    setting=self.setting,
                )
            vetted.append(address)
        return vetted

    def vet_host(self, host: str, port: int) -> list[IPAddress]:
        """The addresses of `host` to connect to, all allowed; OutboundRefused otherwise.

        Raises Unresolvable when a name does not resolve.
        """
        literal = _address(host)
        if literal is not None:
            return self.vet(host, [literal], allowed_by_name=False)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as error:
            raise Unresolvable(f"{host} does not resolve: {error}") from error
        return self.vet(host, _resolved(infos), allowed_by_name=self.allows_name(host))


def _resolved(infos) -> list[IPAddress]:
    """Unique addresses of getaddrinfo's answer, in its order (the resolver's preference)."""
    seen: list[IPAddress] = []
    for _family, _type, _proto, _canonname, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0])
        if address not in seen:
            seen.append(address)
    return seen


@lru_cache(maxsize=32)
def _parsed(setting: str, entries: tuple[str, ...]) -> HostPolicy:
    return HostPolicy.parse(setting, entries)


def policy(purpose: str = OUTBOUND) -> HostPolicy:
    """The policy for `purpose` ("outbound" or "benchmark") from the current Django settings."""
    setting = SETTING_FOR_PURPOSE[purpose]
    return _parsed(setting, tuple(getattr(settings, setting)))


def check_url(url: str, *, purpose: str = OUTBOUND, field: str | None = None) -> str:
    """`url` when the control plane may connect to it; else DomainError naming the rule.

    Resolves the host as the connection would; a name listed in the setting is accepted
    without resolving (cluster DNS may answer only inside the cluster), but the connection
    is still checked when it is made.
    """
    host_policy = policy(purpose)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DomainError(
            f"{url!r} must be an http or https URL with a host.", field=field, code="invalid_url"
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise DomainError(
            f"{url!r} has a malformed port.", field=field, code="invalid_url"
        ) from None
    check_host(parts.hostname, purpose=purpose, field=field, port=port, host_policy=host_policy)
    return url


def check_host(
    host: str,
    *,
    purpose: str = OUTBOUND,
    field: str | None = None,
    port: int = 80,
    host_policy: HostPolicy | None = None,
) -> str:
    """`host` when the control plane may connect to it; else DomainError naming the rule."""
    host_policy = host_policy or policy(purpose)
    try:
        host_policy.vet_host(host, port)
    except OutboundRefused as refused:
        raise DomainError(
            f"{host} is refused: {refused}", field=field, code="outbound_refused"
        ) from refused
    except Unresolvable as error:
        if host_policy.allows_name(host):
            return host
        raise DomainError(
            f"{error}; only host names listed in {host_policy.describe()} are accepted without "
            "resolving (an operator setting).",
            field=field,
            code="outbound_refused",
        ) from error
    return host


# --- Guarded HTTP clients ---------------------------------------------------------------------


class _GuardedSyncBackend(httpcore.SyncBackend):
    def __init__(self, host_policy: HostPolicy) -> None:
        self._policy = host_policy

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            addresses = self._policy.vet_host(host, port)
        except Unresolvable as error:
            raise httpcore.ConnectError(str(error)) from error
        last_error: Exception | None = None
        for address in addresses:
            try:
                # The vetted address, not the name: a second lookup could answer otherwise.
                # TLS still names the host (httpcore passes the URL's host as SNI).
                return super().connect_tcp(
                    str(address),
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                last_error = error
        raise last_error or httpcore.ConnectError(f"{host} has no address")


class _GuardedAsyncBackend(httpcore.AnyIOBackend):
    def __init__(self, host_policy: HostPolicy) -> None:
        self._policy = host_policy

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        literal = _address(host)
        if literal is not None:
            addresses = self._policy.vet(host, [literal], allowed_by_name=False)
        else:
            try:
                with anyio.fail_after(timeout):
                    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except TimeoutError as error:
                raise httpcore.ConnectTimeout(f"resolving {host} timed out") from error
            except (OSError, UnicodeError) as error:
                raise httpcore.ConnectError(f"{host} does not resolve: {error}") from error
            addresses = self._policy.vet(
                host, _resolved(infos), allowed_by_name=self._policy.allows_name(host)
            )
        last_error: Exception | None = None
        for address in addresses:
            try:
                return await super().connect_tcp(
                    str(address),
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                last_error = error
        raise last_error or httpcore.ConnectError(f"{host} has no address")


# httpx's own defaults.
_DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


@lru_cache(maxsize=1)
def default_ssl_context() -> ssl.SSLContext:
    """The SSL context of every client that verifies against the default CA bundle."""
    # Loading the CA bundle costs milliseconds; one context serves every client (it is only
    # read once built). SSL_CERT_FILE / SSL_CERT_DIR still apply: they are the operator's.
    return httpx.create_ssl_context()


def _ssl_context(verify, cert) -> ssl.SSLContext:
    if verify is True and cert is None:
        return default_ssl_context()
    return httpx.create_ssl_context(verify=verify, cert=cert)


class _GuardedPool:
    """httpx's transport over the same connection pool httpx builds, plus the network backend
    that vets every TCP connection (the sync and async transports differ only in the classes)."""

    _pool_class: type
    _backend_class: type

    def __init__(
        self,
        host_policy: HostPolicy,
        *,
        verify: ssl.SSLContext | str | bool = True,
        cert=None,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits = _DEFAULT_LIMITS,
        retries: int = 0,
    ) -> None:
        ssl_context = _ssl_context(verify, cert)
        super().__init__(  # the httpx transport after this class in the MRO
            verify=ssl_context, trust_env=False, http1=http1, http2=http2, limits=limits
        )
        self._pool = self._pool_class(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=http1,
            http2=http2,
            retries=retries,
            network_backend=self._backend_class(host_policy),
        )


class GuardedTransport(_GuardedPool, httpx.HTTPTransport):
    """httpx's transport over a connection pool whose every TCP connection is vetted."""

    _pool_class = httpcore.ConnectionPool
    _backend_class = _GuardedSyncBackend


class AsyncGuardedTransport(_GuardedPool, httpx.AsyncHTTPTransport):
    """The async twin of GuardedTransport."""

    _pool_class = httpcore.AsyncConnectionPool
    _backend_class = _GuardedAsyncBackend


class GuardedClient(httpx.Client):
    """An httpx.Client that never follows a redirect, not even when a call asks it to."""

    def send(self, request, *, stream=False, auth=httpx.USE_CLIENT_DEFAULT, follow_redirects=False):
        # A redirect is the server choosing where we connect next; the caller sees the 3xx.
        return super().send(request, stream=stream, auth=auth, follow_redirects=False)


class AsyncGuardedClient(httpx.AsyncClient):
    """The async twin of GuardedClient: never follows a redirect."""

    async def send(
        self, request, *, stream=False, auth=httpx.USE_CLIENT_DEFAULT, follow_redirects=False
    ):
        return await super().send(request, stream=stream, auth=auth, follow_redirects=False)


_TRANSPORT_KEYWORDS = ("verify", "cert", "http1", "http2", "limits")
# Each of these would connect somewhere the policy does not see.
_REFUSED_KEYWORDS = ("transport", "mounts", "proxy", "trust_env", "follow_redirects", "app")


def _split(kwargs: dict) -> tuple[dict, dict]:
    refused = sorted(set(kwargs) & set(_REFUSED_KEYWORDS))
    if refused:
        raise TypeError(f"a guarded client takes no {', '.join(refused)}")
    transport_kwargs = {k: kwargs.pop(k) for k in _TRANSPORT_KEYWORDS if k in kwargs}
    return transport_kwargs, kwargs


def client(
    *, purpose: str = OUTBOUND, host_policy: HostPolicy | None = None, **kwargs
) -> httpx.Client:
    """An httpx.Client whose connections `purpose`'s allow-list vets; no redirects, no proxy."""
    transport_kwargs, client_kwargs = _split(kwargs)
    transport = GuardedTransport(host_policy or policy(purpose), **transport_kwargs)
    return GuardedClient(
        transport=transport, trust_env=False, follow_redirects=False, **client_kwargs
    )


def async_client(
    *, purpose: str = OUTBOUND, host_policy: HostPolicy | None = None, **kwargs
) -> httpx.AsyncClient:
    """The async twin of `client()`."""
    transport_kwargs, client_kwargs = _split(kwargs)
    transport = AsyncGuardedTransport(host_policy or policy(purpose), **transport_kwargs)
    return AsyncGuardedClient(
        transport=transport, trust_env=False, follow_redirects=False, **client_kwargs
    )


def request(method: str, url: str, *, purpose: str = OUTBOUND, timeout=5.0, **kwargs):
    """One request through a guarded client (the guarded httpx.request)."""
    with client(purpose=purpose, timeout=timeout) as guarded:
        return guarded.request(method, url, **kwargs)


# --- Secrets by name --------------------------------------------------------------------------

ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_ENV_PATTERN = re.compile(r"^[A-Z0-9_*?\[\]!-]+$")
# The control plane's own secrets: no setting lets a config name them, since whoever writes a
# config would have them sent to a host of their choosing.
FORBIDDEN_SECRET_ENV_NAMES = frozenset(
    {
        "SECRET_KEY",
        "DATABASE_URL",
        "REDIS_URL",
        "ADMISSION_REDIS_URL",
        "CELERY_BROKER_URL",
        "PLANNER_PASSWORD",
        "DEMO_PLANNER_PASSWORD",
        "PGPASSWORD",
        "PROCESS_SUPERVISOR_TOKEN",
    }
)
FORBIDDEN_SECRET_ENV_PATTERNS = (
    "TEST_*",
    "DJANGO_*",
    "CELERY_*",
    "*SECRET_KEY*",
    "*DATABASE_URL*",
    "*REDIS_URL*",
)


def parse_secret_env_patterns(entries: typing.Iterable[str]) -> tuple[str, ...]:
    """Raises ValueError naming an entry that is not an env-var name or fnmatch pattern."""
    patterns = []
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        if not _ENV_PATTERN.match(entry):
            raise ValueError(
                f"{entry!r} is not an environment variable name or pattern such as MU_ACTUATOR_*."
            )
        patterns.append(entry)
    return tuple(patterns)


def secret_env_refusal(name: str, allowed_patterns: typing.Iterable[str]) -> str:
    """Why a config may not name the environment variable `name`, or "" when it may."""
    if not ENV_NAME.match(name):
        return "must name an environment variable (upper case letters, digits, underscores)."
    if name in FORBIDDEN_SECRET_ENV_NAMES or any(
        fnmatch.fnmatchcase(name, pattern) for pattern in FORBIDDEN_SECRET_ENV_PATTERNS
    ):
        return f"{name} holds one of the control plane's own secrets, which no config may name."
    allowed = tuple(allowed_patterns)
    if not any(fnmatch.fnmatchcase(name, pattern) for pattern in allowed):
        return (
            f"{name} is not one of the variables actuators may read: "
            f"ACTUATOR_SECRET_ENV_NAMES={','.join(allowed) or '(empty)'} (an operator setting)."
        )
    return ""


def secret_env_refusal_from_settings(name: str) -> str:
    """`secret_env_refusal` under the operator's ACTUATOR_SECRET_ENV_NAMES."""
    return secret_env_refusal(name, settings.ACTUATOR_SECRET_ENV_NAMES)


# --- Kubernetes cluster profiles ----------------------------------------------------------------

_PROFILE_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
_PROFILE_KEYS = frozenset(
    {"kubeconfig", "context", "api_server", "token_env", "verify_tls", "in_cluster"}
)


def parse_kubernetes_clusters(text_or_value, *, secret_env_patterns: typing.Iterable[str]) -> dict:
    """Profiles {name: {...}} from JSON (or an already parsed dict); ValueError naming the fault.

    Each profile has exactly one of `kubeconfig` (a file path; optional `context`),
    `api_server` (http(s) URL; optional `token_env`, `verify_tls`) or `in_cluster: true`.
    """
    value = text_or_value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError('must be a JSON object of profiles, e.g. {"prod": {"kubeconfig": "..."}}.')
    patterns = tuple(secret_env_patterns)
    profiles = {}
    for name, profile in value.items():
        where = f"profile {name!r}"
        if not isinstance(name, str) or not _PROFILE_NAME.match(name):
            raise ValueError(f"{where}: names are lower-case letters, digits, '.', '_' and '-'.")
        if not isinstance(profile, dict):
            raise ValueError(f"{where} must be an object.")
        unknown = sorted(set(profile) - _PROFILE_KEYS)
        if unknown:
            raise ValueError(f"{where} has unknown key(s): {', '.join(unknown)}.")
        sources = [key for key in ("kubeconfig", "api_server", "in_cluster") if profile.get(key)]
        if len(sources) != 1:
            raise ValueError(f"{where} needs exactly one of kubeconfig, api_server or in_cluster.")
        if "in_cluster" in profile and profile["in_cluster"] is not True and profile["in_cluster"]:
            raise ValueError(f"{where}: in_cluster must be true.")
        if "kubeconfig" in profile and not isinstance(profile["kubeconfig"], str):
            raise ValueError(f"{where}: kubeconfig must be a file path.")
        if "context" in profile and (
            "kubeconfig" not in profile or not isinstance(profile["context"], str)
        ):
            raise ValueError(f"{where}: context applies only to a kubeconfig, as a name.")
        if "api_server" in profile:
            parts = urlsplit(str(profile["api_server"]))
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{where}: api_server must be an http or https URL.")
        for key in ("token_env", "verify_tls"):
            if key in profile and "api_server" not in profile:
                raise ValueError(f"{where}: {key} applies only with api_server.")
        if "verify_tls" in profile and not isinstance(profile["verify_tls"], bool):
            raise ValueError(f"{where}: verify_tls must be true or false.")
        if "token_env" in profile:
            refusal = secret_env_refusal(str(profile["token_env"]), patterns)
            if refusal:
                raise ValueError(f"{where}: token_env: {refusal}")
        profiles[name] = dict(profile)
    return profiles


# --- Secrets bound to their destinations ---------------------------------------------------------

# The kinds of destination an actuator secret is sent to. A process supervisor's token is sent
# as a bearer token (scale, status, restart); a webhook's secret signs its requests; a cluster
# profile's token goes to that cluster's API server.
SUPERVISOR = "supervisor"
WEBHOOK = "webhook"
CLUSTER = "cluster"
BINDABLE_KINDS = (SUPERVISOR, WEBHOOK)  # cluster tokens are bound by KUBERNETES_CLUSTERS
_DESTINATION_NOUNS = {SUPERVISOR: "the process supervisor", WEBHOOK: "the webhook"}
_A_DESTINATION = {SUPERVISOR: "a process supervisor", WEBHOOK: "a webhook", CLUSTER: "a cluster"}
_BINDING_EXAMPLE = '{"MU_ACTUATOR_GPU07_TOKEN": {"supervisor": ["http://gpu-07:8190"]}}'


class SecretRefused(Exception):
    """A secret asked for where the operator did not bind it; nothing was read or sent."""


def _normal_host(host: str) -> str:
    address = _address(host)
    return str(address) if address is not None else host.lower().rstrip(".")


def _origin(scheme: str, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}" if scheme else f"{shown}:{port}"


def _url_origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) as the HTTP client parses `url` (httpx's parser, so the check and
    the connection agree on the host); ValueError when it is not an http(s) URL."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as error:
        raise ValueError(f"{url!r} is not a URL: {error}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http or https URL with a host.")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.scheme, _normal_host(parsed.host), port


@dataclass(frozen=True)
class Destination:
    """Where a secret may be sent: an origin (`scheme://host:port`, the port defaulted by the
    scheme) or `host:port` (either scheme). Host names match exactly (case aside), addresses as
    addresses: another port of the same host is another destination."""

    scheme: str  # "" for either
    host: str
    port: int
    text: str  # as the operator wrote it

    @classmethod
    def parse(cls, text: str) -> Destination:
        """A destination as the operator wrote it; ValueError saying what is wrong with it."""
        raw = text.strip()
        with_scheme = "://" in raw
        try:
            parsed = httpx.URL(raw if with_scheme else f"http://{raw}")
        except httpx.InvalidURL as error:
            raise ValueError(
                f"{text!r} is not a destination such as http://gpu-07:8190: {error}"
            ) from None
        if with_scheme and parsed.scheme not in ("http", "https"):
            raise ValueError(f"{text!r}: a destination's scheme is http or https.")
        if parsed.userinfo or parsed.query or parsed.fragment or parsed.raw_path != b"/":
            raise ValueError(
                f"{text!r}: a destination is scheme://host:port or host:port, without a user, "
                "path or query (a secret is bound to a host and port, not to a path)."
            )
        host = _normal_host(parsed.host)
        if _address(host) is None and not _HOST_NAME.match(host):
            raise ValueError(f"{text!r}: {parsed.host!r} is not a host name or an IP address.")
        if not with_scheme and not re.search(r":[0-9]+$", raw):
            raise ValueError(f"{text!r} needs a port (host:port), or a scheme (https://host).")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        return cls(parsed.scheme if with_scheme else "", host, port, raw)

    def admits(self, scheme: str, host: str, port: int) -> bool:
        """Whether a request to this origin goes to this destination."""
        return (not self.scheme or scheme == self.scheme) and (host, port) == (self.host, self.port)


@dataclass(frozen=True)
class SecretBinding:
    """Where one secret may go: a kind of destination and its hosts, or cluster profiles."""

    kind: str  # SUPERVISOR, WEBHOOK or CLUSTER
    destinations: tuple[Destination, ...] = ()  # SUPERVISOR and WEBHOOK
    clusters: tuple[str, ...] = ()  # CLUSTER: the profiles whose token_env it is

    def describe(self) -> str:
        """Where the secret is bound, in words, for a refusal that names both destinations."""
        if self.kind == CLUSTER:
            names = ", ".join(f"'{name}'" for name in self.clusters)
            return f"cluster profile{'s' if len(self.clusters) > 1 else ''} {names}"
        where = " or ".join(d.text for d in self.destinations)
        return f"{_DESTINATION_NOUNS[self.kind]} at {where}"


@dataclass(frozen=True)
class SecretBindings:
    """Where each actuator secret may go: ACTUATOR_SECRET_DESTINATIONS binds a name to one kind
    of destination (a supervisor's token never signs a webhook) and its hosts; a cluster
    profile's `token_env` is bound to that profile. An unbound name goes nowhere unless the
    operator turned ACTUATOR_ALLOW_UNBOUND_SECRETS on (the behaviour before bindings)."""

    by_name: dict[str, SecretBinding]
    allow_unbound: bool

    def refusal(self, name: str, *, kind: str, url: str = "", cluster: str = "") -> str:
        """Why the secret in `name` may not go to `url` (a supervisor or a webhook) or to the
        cluster profile `cluster`, or "" when it may."""
        binding = self.by_name.get(name)
        if binding is None:
            if self.allow_unbound:
                return ""
            return (
                f"{name} is bound to no destination: ACTUATOR_SECRET_DESTINATIONS (an operator "
                f"setting) must name where it may be sent, e.g. {_BINDING_EXAMPLE}; "
                "ACTUATOR_ALLOW_UNBOUND_SECRETS would send unbound secrets to any allowed host."
            )
        if binding.kind == CLUSTER:
            if kind == CLUSTER and cluster in binding.clusters:
                return ""
            return (
                f"{name} is the token of {binding.describe()} (KUBERNETES_CLUSTERS) and is sent "
                "to that cluster only."
            )
        if kind != binding.kind:
            return (
                f"{name} is bound to {binding.describe()} (ACTUATOR_SECRET_DESTINATIONS, an "
                f"operator setting), not to {_A_DESTINATION[kind]}: each destination has a "
                "secret of its own."
            )
        try:
            scheme, host, port = _url_origin(url)
        except ValueError as error:
            return str(error)
        if any(d.admits(scheme, host, port) for d in binding.destinations):
            return ""
        return (
            f"{name} may be sent only to {binding.describe()} (ACTUATOR_SECRET_DESTINATIONS, an "
            f"operator setting), not to {_origin(scheme, host, port)}."
        )


def _cluster_tokens(kubernetes_clusters: dict) -> dict[str, tuple[str, ...]]:
    tokens: dict[str, list[str]] = {}
    for profile_name, profile in kubernetes_clusters.items():
        if isinstance(profile, dict) and profile.get("token_env"):
            tokens.setdefault(str(profile["token_env"]), []).append(profile_name)
    return {name: tuple(sorted(profiles)) for name, profiles in tokens.items()}


def secret_bindings(
    destinations,
    *,
    kubernetes_clusters: dict,
    secret_env_patterns: typing.Iterable[str],
    allow_unbound: bool = False,
) -> SecretBindings:
    """The bindings of ACTUATOR_SECRET_DESTINATIONS (JSON text or its parsed value) and of the
    cluster profiles; ValueError naming the fault."""
    value = destinations
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object such as {_BINDING_EXAMPLE}.")
    patterns = tuple(secret_env_patterns)
    cluster_tokens = _cluster_tokens(kubernetes_clusters)
    by_name = {
        name: SecretBinding(CLUSTER, clusters=profiles) for name, profiles in cluster_tokens.items()
    }
    for name, binding in value.items():
        refusal = secret_env_refusal(str(name), patterns)
        if refusal:
            raise ValueError(f"{name}: {refusal}")
        if name in cluster_tokens:
            raise ValueError(
                f"{name} is the token of {by_name[name].describe()} (KUBERNETES_CLUSTERS), "
                "bound to that cluster; give the supervisor or webhook a secret of its own."
            )
        if not isinstance(binding, dict) or not binding:
            raise ValueError(
                f"{name}: bind it to one kind of destination ({', '.join(BINDABLE_KINDS)}) "
                f"and its hosts, e.g. {_BINDING_EXAMPLE}."
            )
        if len(binding) > 1:
            raise ValueError(
                f"{name} is bound to {' and '.join(sorted(binding))}: one kind of destination "
                "per secret, so that a supervisor's token never signs a webhook."
            )
        [(kind, entries)] = binding.items()
        if kind not in BINDABLE_KINDS:
            raise ValueError(
                f"{name}: {kind!r} is not a kind of destination ({', '.join(BINDABLE_KINDS)}); "
                "a cluster's token is bound by its KUBERNETES_CLUSTERS profile (token_env)."
            )
        if isinstance(entries, str):
            entries = [entries]
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{name}: {kind} needs a list of destinations (host:port, or URLs).")
        parsed = []
        for entry in entries:
            if not isinstance(entry, str):
                raise ValueError(f"{name}: {entry!r} is not a destination (host:port, or a URL).")
            try:
                parsed.append(Destination.parse(entry))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        by_name[name] = SecretBinding(kind, destinations=tuple(parsed))
    return SecretBindings(by_name, allow_unbound)


def parse_secret_destinations(
    text: str, *, kubernetes_clusters: dict, secret_env_patterns: typing.Iterable[str]
) -> dict:
    """ACTUATOR_SECRET_DESTINATIONS as settings keep it, {NAME: {kind: [destination, ...]}};
    ValueError naming the fault (settings.py refuses to start on it)."""
    bindings = secret_bindings(
        text, kubernetes_clusters=kubernetes_clusters, secret_env_patterns=secret_env_patterns
    )
    return {
        name: {binding.kind: [d.text for d in binding.destinations]}
        for name, binding in bindings.by_name.items()
        if binding.kind != CLUSTER
    }


def secret_bindings_from_settings() -> SecretBindings:
    """The operator's bindings, as the settings hold them (read on each call, not cached)."""
    return secret_bindings(
        settings.ACTUATOR_SECRET_DESTINATIONS,
        kubernetes_clusters=settings.KUBERNETES_CLUSTERS,
        secret_env_patterns=settings.ACTUATOR_SECRET_ENV_NAMES,
        allow_unbound=settings.ACTUATOR_ALLOW_UNBOUND_SECRETS,
    )


def secret_destination_refusal_from_settings(
    name: str, *, kind: str, url: str = "", cluster: str = ""
) -> str:
    """Why the secret `name` may not go to this destination under the operator's settings, or
    "" when it may (`SecretBindings.refusal`)."""
    return secret_bindings_from_settings().refusal(name, kind=kind, url=url, cluster=cluster)


def actuator_secret(name: str, *, kind: str, url: str = "", cluster: str = "") -> str:
    """The value of the environment variable `name`, to send to `url` (a supervisor or webhook,
    the very URL requested) or to the cluster profile `cluster`; "" when it is unset.

    The one place actuators read a secret: checked here, at send time, whatever was checked when
    the config was written (a config stored before a binding changed never leaks). Raises
    SecretRefused, before reading anything, when the secret is not bound there."""
    refusal = secret_destination_refusal_from_settings(name, kind=kind, url=url, cluster=cluster)
    if refusal:
        raise SecretRefused(refusal)
    return os.environ.get(name, "")


# --- Guarded aiohttp sessions (the load runner: many streams, little per-request overhead) -----


class AddressRefused(ConnectionRefusedError):
    """A connection the policy refuses, raised where aiohttp makes the socket; aiohttp reports
    it as a ClientConnectorError carrying this message (its strerror)."""


@lru_cache(maxsize=1)
def _aiohttp_guard_class() -> type:
    """The guard's class, built on first use: settings import this module in every process,
    and aiohttp costs a few hundred milliseconds to import that only the runner needs."""
    import aiohttp
    import aiohttp.abc

    class _AiohttpGuard(aiohttp.abc.AbstractResolver):
        """Vets every address an aiohttp connector connects to, on the address itself.

        Host names go through this resolver, which vets the answer (a name on the allow-list may
        resolve anywhere but the metadata ranges). aiohttp never resolves an IP literal, so the
        socket factory vets every address again when the socket is made: literals against the
        networks, resolved addresses as the resolver vetted them (it remembers what it let
        through; a literal equal to an allowed name's address is that host, and allowed too)."""

        def __init__(self, host_policy: HostPolicy) -> None:
            self._policy = host_policy
            self._inner = aiohttp.ThreadedResolver()
            self._vetted: set[IPAddress] = set()

        async def resolve(
            self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
        ):
            answers = await self._inner.resolve(host, port, family)
            addresses = [ipaddress.ip_address(answer["host"]) for answer in answers]
            try:
                self._policy.vet(host, addresses, allowed_by_name=self._policy.allows_name(host))
            except OutboundRefused as refused:
                # An OSError, so aiohttp reports it as the connection's error, as it does below.
                raise AddressRefused(errno.ECONNREFUSED, str(refused)) from refused
            self._vetted.update(addresses)
            return answers

        async def close(self) -> None:
            await self._inner.close()

        def socket(self, addr_info) -> socket.socket:
            family, kind, proto, _canonname, sockaddr = addr_info
            address = ipaddress.ip_address(sockaddr[0])
            if address not in self._vetted:
                refusal = self._policy.address_refusal(address)
                if refusal:
                    raise AddressRefused(errno.ECONNREFUSED, f"{refusal} (an operator setting)")
            return socket.socket(family=family, type=kind, proto=proto)

    return _AiohttpGuard


def aiohttp_session(
    host_policy: HostPolicy, *, timeout_seconds: float, connections: int = 0
) -> typing.Any:  # an aiohttp.ClientSession
    """An aiohttp session whose every connection `host_policy` vets; no proxy from the
    environment (trust_env off). Callers pass allow_redirects=False on each request: a
    redirect would be the server choosing where we connect next."""
    import aiohttp  # on first use: see _aiohttp_guard_class

    guard = _aiohttp_guard_class()(host_policy)
    connector = aiohttp.TCPConnector(
        limit=connections,
        resolver=guard,
        socket_factory=guard.socket,
        ssl=default_ssl_context(),
        ttl_dns_cache=60,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_seconds),
        trust_env=False,
        # Nothing a server sets is sent back: load is not a browsing session.
        cookie_jar=aiohttp.DummyCookieJar(),
    )

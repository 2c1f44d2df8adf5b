"""What the control plane may reach: allow-lists checked on the resolved address when the
connection is made, metadata ranges refused whatever the allow-list, no redirects followed,
and which secrets a config may name. Real resolution (`localhost`) and real local servers."""

import asyncio
import ipaddress
import socket

import aiohttp
import httpx
import pytest

from core import outbound
from core.errors import DomainError
from tests.support.recording_server import RecordingServer

METADATA_ADDRESSES = [
    "169.254.169.254",
    "169.254.0.1",
    "fe80::1",
    "100.100.100.200",
    "fd00:ec2::254",
    "::ffff:169.254.169.254",
]


def policy(*entries: str, setting: str = "OUTBOUND_ALLOWED_HOSTS") -> outbound.HostPolicy:
    return outbound.HostPolicy.parse(setting, entries)


@pytest.fixture
def listener():
    with RecordingServer() as server:
        yield server


def test_it_allows_what_the_default_allow_list_names(listener):
    default = policy(*outbound.DEFAULT_ALLOWED_HOSTS)

    with outbound.client(host_policy=default, timeout=2) as client:
        by_address = client.get(f"{listener.url}/a")
        by_name = client.get(listener.url.replace("127.0.0.1", "localhost") + "/b")

    assert (by_address.status_code, by_name.status_code) == (200, 200)
    assert [r.path for r in listener.requests] == ["/a", "/b"]


def test_it_refuses_a_name_that_resolves_outside_the_allow_list(listener, settings):
    # `localhost` really resolves to 127.0.0.1, which the lab's allow-list does not hold.
    settings.OUTBOUND_ALLOWED_HOSTS = ["10.0.0.0/8"]
    url = listener.url.replace("127.0.0.1", "localhost")

    with pytest.raises(DomainError) as refused:
        outbound.check_url(url, field="actuator_config.url")
    with (
        outbound.client(timeout=2) as client,
        pytest.raises(outbound.OutboundRefused) as at_connect,
    ):
        client.get(url)

    assert refused.value.field == "actuator_config.url"
    assert "127.0.0.1 is not in OUTBOUND_ALLOWED_HOSTS=10.0.0.0/8" in refused.value.message
    assert at_connect.value.address == "127.0.0.1"
    assert at_connect.value.setting == "OUTBOUND_ALLOWED_HOSTS"
    assert listener.requests == []


def test_a_refused_connection_is_an_httpx_connect_error_naming_address_and_setting(listener):
    with (
        outbound.client(host_policy=policy("10.0.0.0/8"), timeout=2) as client,
        pytest.raises(httpx.ConnectError, match=r"127\.0\.0\.1 is not in OUTBOUND_ALLOWED_HOSTS"),
    ):
        client.get(listener.url)


@pytest.mark.parametrize("address", METADATA_ADDRESSES)
def test_it_refuses_metadata_and_link_local_addresses_even_when_everything_is_allowed(address):
    everything = policy("0.0.0.0/0", "::/0")
    host = f"[{address}]" if ":" in address else address

    with pytest.raises(outbound.OutboundRefused, match="link-local or cloud-metadata"):
        everything.vet_host(address, 80)
    # Refused before any packet: no such host answers here, and none is needed.
    with (
        outbound.client(host_policy=everything, timeout=2) as client,
        pytest.raises(outbound.OutboundRefused),
    ):
        client.get(f"http://{host}/latest/meta-data/")


def test_an_allow_list_entry_inside_a_metadata_range_opens_it():
    assert policy("169.254.169.254").address_refusal(ipaddress.ip_address("169.254.169.254")) == ""
    assert policy("169.254.0.0/16").address_refusal(ipaddress.ip_address("169.254.3.4")) == ""
    assert policy("169.254.169.254").address_refusal(ipaddress.ip_address("169.254.169.253"))
    assert policy("0.0.0.0/0").address_refusal(ipaddress.ip_address("169.254.169.254"))


def test_a_name_allowed_by_name_is_still_refused_when_it_resolves_to_a_metadata_address(
    monkeypatch,
):
    # A name the operator listed whose DNS answer changes after the write-time check (DNS
    # rebinding): the connection is checked on the address it would really go to.
    hooks = policy("*.hooks.internal")

    def rebinding_resolver(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_resolver)
    with (
        outbound.client(host_policy=hooks, timeout=2) as client,
        pytest.raises(outbound.OutboundRefused, match="169.254.169.254 is a link-local"),
    ):
        client.get("http://scale.hooks.internal/")


def test_it_connects_to_the_address_it_checked_and_keeps_the_host_name(monkeypatch, listener):
    # The name is looked up once: a client that checked it, then connected by name, would
    # look it up again and could be answered otherwise (DNS rebinding).
    real_getaddrinfo = socket.getaddrinfo
    lookups = []

    def resolver(host, port, *args, **kwargs):
        if host == "engine.lab":
            lookups.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    port = listener.url.rsplit(":", 1)[1]
    with outbound.client(host_policy=policy("127.0.0.0/8"), timeout=2) as client:
        response = client.get(f"http://engine.lab:{port}/v1/models")

    assert response.status_code == 200
    assert lookups == ["engine.lab"]
    assert listener.requests[0].headers["host"] == f"engine.lab:{port}"


def test_it_follows_no_redirect_even_when_a_call_asks_to():
    with (
        RecordingServer(host="127.0.0.2") as elsewhere,
        RecordingServer(status=302, headers={"Location": f"{elsewhere.url}/x"}) as redirecting,
    ):
        only_the_first = policy("127.0.0.1/32")
        with outbound.client(host_policy=only_the_first, timeout=2) as client:
            response = client.get(redirecting.url, follow_redirects=True)

        assert response.status_code == 302
        assert len(redirecting.requests) == 1
        assert elsewhere.requests == []


def test_the_async_client_checks_connections_too(listener):
    async def fetch(host_policy):
        async with outbound.async_client(host_policy=host_policy, timeout=2) as client:
            return await client.get(listener.url)

    assert asyncio.run(fetch(policy("127.0.0.0/8"))).status_code == 200
    with pytest.raises(outbound.OutboundRefused):
        asyncio.run(fetch(policy("10.0.0.0/8")))
    assert len(listener.requests) == 1


def test_a_guarded_client_takes_no_proxy_and_no_transport_of_its_own():
    for keyword in ("proxy", "transport", "mounts", "trust_env", "follow_redirects"):
        with pytest.raises(TypeError, match=keyword):
            outbound.client(host_policy=policy("127.0.0.1"), **{keyword: None})


def test_a_url_whose_name_does_not_resolve_is_refused_unless_listed_by_name(settings):
    settings.OUTBOUND_ALLOWED_HOSTS = ["127.0.0.0/8", "*.svc.cluster.local"]

    with pytest.raises(DomainError, match="only host names listed in OUTBOUND_ALLOWED_HOSTS"):
        outbound.check_url("http://nowhere.invalid/scale")
    # Cluster DNS answers only inside the cluster: a listed name is taken as it is.
    assert outbound.check_url("http://engine.inference.svc.cluster.local:8000")


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("10.0.0.1/8", "is not a CIDR"),
        ("*", "not a CIDR, an IP address or a host name"),
        ("http://10.0.0.1", "is not a CIDR"),
        ("hooks.example.com:443", "not a CIDR, an IP address or a host name"),
    ],
)
def test_a_malformed_allow_list_entry_is_refused_naming_it(entry, says):
    with pytest.raises(ValueError, match=says):
        outbound.HostPolicy.parse("OUTBOUND_ALLOWED_HOSTS", ["127.0.0.1", entry])


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("SECRET_KEY", "the control plane's own secrets"),
        ("DATABASE_URL", "the control plane's own secrets"),
        ("REDIS_URL", "the control plane's own secrets"),
        ("ADMISSION_REDIS_URL", "the control plane's own secrets"),
        ("TEST_DATABASE_URL", "the control plane's own secrets"),
        ("HOME", "not one of the variables actuators may read"),
        ("lower_case", "must name an environment variable"),
    ],
)
def test_a_config_may_not_name_the_control_planes_secrets_whatever_the_setting(name, says):
    # Even an operator who allows every name does not open the control plane's own.
    assert says in outbound.secret_env_refusal(name, ["*"] if "own" in says else ["MU_*"])
    assert outbound.secret_env_refusal("MU_ACTUATOR_HOOK", ["MU_ACTUATOR_*"]) == ""


@pytest.mark.parametrize(
    ("profiles", "says"),
    [
        ('{"prod": {"kubeconfig": "/k", "api_server": "https://k:6443"}}', "exactly one of"),
        ('{"prod": {}}', "exactly one of"),
        ('{"prod": {"in_cluster": true, "token_env": "MU_ACTUATOR_T"}}', "only with api_server"),
        ('{"prod": {"api_server": "https://k:6443", "token_env": "SECRET_KEY"}}', "own secrets"),
        ('{"prod": {"kubeconfig": "/k", "user": "x"}}', "unknown key(s): user"),
        ('{"Prod!": {"in_cluster": true}}', "names are lower-case"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_a_cluster_profile_that_cannot_work_is_refused(profiles, says):
    with pytest.raises(ValueError) as refused:
        outbound.parse_kubernetes_clusters(profiles, secret_env_patterns=["MU_ACTUATOR_*"])
    assert says in str(refused.value)


# --- Secrets bound to their destinations (issue 34) ----------------------------------------


def bindings(destinations, clusters=None, **kwargs) -> outbound.SecretBindings:
    return outbound.secret_bindings(
        destinations,
        kubernetes_clusters=clusters or {},
        secret_env_patterns=["MU_ACTUATOR_*"],
        **kwargs,
    )


@pytest.mark.parametrize(
    ("bound_to", "url", "admitted"),
    [
        ("http://gpu-07:8190", "http://gpu-07:8190/scale", True),
        ("http://gpu-07:8190", "http://GPU-07.:8190/status", True),
        ("http://gpu-07:8190", "https://gpu-07:8190/scale", False),  # the scheme is bound too
        ("gpu-07:8190", "https://gpu-07:8190/scale", True),  # host:port: either scheme
        ("http://gpu-07:8190", "http://gpu-07:8191/scale", False),  # another port
        ("http://gpu-07:8190", "http://gpu-07.attacker.example:8190/", False),
        ("http://gpu-07:8190", "http://10.0.0.7:8190/", False),  # names match as names
        # The userinfo trick: the client connects to the host after the "@".
        ("http://gpu-07:8190", "http://gpu-07:8190\\@10.9.9.9/scale", False),
        ("https://hooks.example", "https://hooks.example:443/scale", True),
        ("https://hooks.example", "http://hooks.example:443/scale", False),
        ("[::1]:8190", "http://[0:0::1]:8190/scale", True),
        ("127.0.0.1:8190", "http://127.1:8190/scale", False),  # what the URL spells, not more
    ],
)
def test_a_secret_goes_only_to_the_host_and_port_it_is_bound_to(bound_to, url, admitted):
    bound = bindings({"MU_ACTUATOR_T": {"supervisor": [bound_to]}})

    refusal = bound.refusal("MU_ACTUATOR_T", kind=outbound.SUPERVISOR, url=url)

    assert (refusal == "") is admitted, refusal


@pytest.mark.parametrize(
    ("destinations", "says"),
    [
        ("{nope", "is not JSON"),
        ('["MU_ACTUATOR_T"]', "must be a JSON object"),
        ('{"SECRET_KEY": {"webhook": ["h:1"]}}', "the control plane's own secrets"),
        ('{"HOME": {"webhook": ["h:1"]}}', "not one of the variables actuators may read"),
        ('{"MU_ACTUATOR_T": ["http://h:1"]}', "bind it to one kind of destination"),
        (
            '{"MU_ACTUATOR_T": {"supervisor": ["h:1"], "webhook": ["h:2"]}}',
            "MU_ACTUATOR_T is bound to supervisor and webhook: one kind of destination per secret",
        ),
        ('{"MU_ACTUATOR_T": {"cluster": ["prod"]}}', "'cluster' is not a kind of destination"),
        ('{"MU_ACTUATOR_T": {"webhook": []}}', "needs a list of destinations"),
        ('{"MU_ACTUATOR_T": {"webhook": ["hooks.example"]}}', "needs a port"),
        ('{"MU_ACTUATOR_T": {"webhook": ["https://h/scale"]}}', "without a user, path or query"),
        ('{"MU_ACTUATOR_T": {"webhook": ["ftp://h:21"]}}', "scheme is http or https"),
        ('{"MU_ACTUATOR_T": {"webhook": ["h!:1"]}}', "is not a host name or an IP address"),
    ],
)
def test_a_binding_that_cannot_work_is_refused_naming_it(destinations, says):
    with pytest.raises(ValueError) as refused:
        bindings(destinations)
    assert says in str(refused.value)


def test_a_cluster_profiles_token_goes_to_that_cluster_only():
    clusters = {"lab": {"api_server": "https://10.0.0.1:6443", "token_env": "MU_ACTUATOR_K8S"}}
    bound = bindings({}, clusters)

    assert bound.refusal("MU_ACTUATOR_K8S", kind=outbound.CLUSTER, cluster="lab") == ""
    assert "is the token of cluster profile 'lab' (KUBERNETES_CLUSTERS)" in bound.refusal(
        "MU_ACTUATOR_K8S", kind=outbound.CLUSTER, cluster="other"
    )
    assert "sent to that cluster only" in bound.refusal(
        "MU_ACTUATOR_K8S", kind=outbound.SUPERVISOR, url="https://10.0.0.1:6443/"
    )
    # Bound by its profile already, it may not be bound to a supervisor as well.
    with pytest.raises(ValueError, match="MU_ACTUATOR_K8S is the token of cluster profile 'lab'"):
        bindings({"MU_ACTUATOR_K8S": {"supervisor": ["10.0.0.1:6443"]}}, clusters)


def test_an_unbound_secret_goes_nowhere_unless_the_operator_allows_unbound_secrets():
    strict = bindings({"MU_ACTUATOR_T": {"webhook": ["h:1"]}})
    lenient = bindings({"MU_ACTUATOR_T": {"webhook": ["h:1"]}}, allow_unbound=True)

    assert "MU_ACTUATOR_OTHER is bound to no destination" in strict.refusal(
        "MU_ACTUATOR_OTHER", kind=outbound.WEBHOOK, url="http://h:1/"
    )
    assert lenient.refusal("MU_ACTUATOR_OTHER", kind=outbound.WEBHOOK, url="http://x:2/") == ""
    # A bound secret stays bound, and to its kind.
    assert "may be sent only to the webhook at h:1" in lenient.refusal(
        "MU_ACTUATOR_T", kind=outbound.WEBHOOK, url="http://x:2/"
    )
    assert "not to a process supervisor" in lenient.refusal(
        "MU_ACTUATOR_T", kind=outbound.SUPERVISOR, url="http://h:1/"
    )


def test_an_actuator_reads_a_secret_only_for_its_destination(settings, monkeypatch):
    monkeypatch.setenv("MU_ACTUATOR_T", "the-token")
    settings.ACTUATOR_SECRET_DESTINATIONS = {"MU_ACTUATOR_T": {"supervisor": ["h:8190"]}}

    read = outbound.actuator_secret("MU_ACTUATOR_T", kind=outbound.SUPERVISOR, url="http://h:8190/")
    with pytest.raises(outbound.SecretRefused, match="not to http://elsewhere:8190") as refused:
        outbound.actuator_secret(
            "MU_ACTUATOR_T", kind=outbound.SUPERVISOR, url="http://elsewhere:8190/scale"
        )

    assert read == "the-token"
    assert "the-token" not in str(refused.value)


# --- The aiohttp session (the load runner) ------------------------------------------------


async def _aiohttp_get(host_policy: outbound.HostPolicy, url: str) -> int:
    async with (
        outbound.aiohttp_session(host_policy, timeout_seconds=2) as session,
        session.get(url, allow_redirects=False) as response,
    ):
        return response.status


def test_the_aiohttp_session_allows_what_the_default_allow_list_names(listener):
    default = policy(*outbound.DEFAULT_ALLOWED_HOSTS)

    by_address = asyncio.run(_aiohttp_get(default, f"{listener.url}/a"))
    by_name = asyncio.run(_aiohttp_get(default, listener.url.replace("127.0.0.1", "localhost")))

    assert (by_address, by_name) == (200, 200)
    assert len(listener.requests) == 2


@pytest.mark.parametrize("by", ["address", "name"])
def test_the_aiohttp_session_refuses_an_address_outside_the_allow_list_naming_it(listener, by):
    # An IP literal never reaches aiohttp's resolver: the socket factory refuses it; a name
    # (`localhost` really resolves to 127.0.0.1) is refused on its answer.
    url = listener.url if by == "address" else listener.url.replace("127.0.0.1", "localhost")

    with pytest.raises(
        aiohttp.ClientError, match=r"127\.0\.0\.1 is not in BENCHMARK_ALLOWED_HOSTS=10\.0\.0\.0/8"
    ):
        asyncio.run(_aiohttp_get(policy("10.0.0.0/8", setting="BENCHMARK_ALLOWED_HOSTS"), url))
    assert listener.requests == []


def test_the_aiohttp_session_refuses_metadata_even_when_everything_is_allowed():
    everything = policy("0.0.0.0/0", "::/0")

    with pytest.raises(aiohttp.ClientError, match="link-local or cloud-metadata"):
        asyncio.run(_aiohttp_get(everything, "http://169.254.169.254/latest/meta-data/"))


def test_the_aiohttp_session_refuses_a_listed_name_that_rebinds_to_metadata(monkeypatch):
    hooks = policy("*.hooks.internal")

    def rebinding_resolver(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_resolver)
    with pytest.raises(aiohttp.ClientError, match="169.254.169.254 is a link-local"):
        asyncio.run(_aiohttp_get(hooks, "http://scale.hooks.internal/"))

"""Who may touch what in Redis: the ACL users of a deployment (docs/gateway-contract.md, "Redis
access"; `manage.py redis_acl` prints them for an aclfile or applies them).

Redis write access was a full bypass (issue 34, finding 9): a forged `gw:v1:keys` entry got
200 and a forged `gw:v1:spool` entry was billed. Two users, then:

- `controlplane` owns every key: the publications, the admission state the control plane
  writes (limits, floors, request limits, the tick's heartbeat), the Celery broker.
- `gateway` reads the publications and the admission state, and writes only what gateways
  write: its spool, `gw:v1:waiting`, its workers' heartbeats, and the admission keys a decision
  writes (buckets, records, request-limit logs, slots in flight, the open index). Those are the
  patterns of `GATEWAY_WRITES`, the one list the ACL names. Nothing else: not the publications
  (signed besides, capacity.publication.signing), not the floors or limits admission decides
  by, not the broker, and no administrative or dangerous command.

The admission keys stay under `adm:`, which the control plane's own admission API shares with
the gateways (the same buckets, the same records); the ACL tells the two kinds of `adm:` key
apart by pattern.
"""

from __future__ import annotations

from capacity.admission.gateways import SPOOL, WAITING, WORKERS
from capacity.admission.redis_layout import OPEN_REQUESTS_KEY, PREFIX

CONTROL_PLANE_USER = "controlplane"
GATEWAY_USER = "gateway"

# Read only: every publication and all admission state.
GATEWAY_READS = ("gw:v1:*", f"{PREFIX}:*")
# Read and write: what a gateway writes, and nothing more.
GATEWAY_WRITES = (
    SPOOL,
    WAITING,
    WORKERS,
    f"{PREFIX}:g:*",  # guaranteed buckets
    f"{PREFIX}:be:*",  # best-effort buckets
    f"{PREFIX}:req:*",  # admission records
    f"{PREFIX}:rlog:*",  # request-limit logs, their token sums and slots in flight
    f"{PREFIX}:rtok:*",
    f"{PREFIX}:rcc:*",
    OPEN_REQUESTS_KEY,
)
# Commands: connection, transactions, reads and writes (of the keys above only) and scripts
# (run as this user: each command a script calls is checked against the same keys). Never an
# administrative or dangerous one (FLUSHALL, CONFIG, KEYS, DEBUG, ...), nor the script and
# function commands that would change what every client runs.
GATEWAY_COMMANDS = (
    "-@all",
    "+@connection",
    "+@transaction",
    "+@read",
    "+@write",
    "+@scripting",
    "+time",  # the scripts' clock
    "-@dangerous",
    "-@admin",
    "-@pubsub",
    "-script|flush",
    "-script|kill",
    "-function",
)


def gateway_rules() -> str:
    """The gateway user's rules, without its password."""
    keys = [f"%R~{pattern}" for pattern in GATEWAY_READS]
    keys += [f"~{pattern}" for pattern in GATEWAY_WRITES]
    return " ".join(["resetkeys", "resetchannels", *keys, *GATEWAY_COMMANDS])


def control_plane_rules() -> str:
    """The control plane user's rules, without its password: every key, every command."""
    return "resetkeys resetchannels ~* &* +@all"


def acl_lines(*, control_plane_password: str, gateway_password: str) -> list[str]:
    """The users as aclfile lines (`aclfile` in redis.conf), the default user off."""
    for name, password in (
        ("control plane", control_plane_password),
        ("gateway", gateway_password),
    ):
        if len(password) < 32 or any(c.isspace() for c in password):
            raise ValueError(f"the {name}'s Redis password must be 32+ characters, no spaces")
    return [
        "user default off resetkeys -@all",
        f"user {CONTROL_PLANE_USER} on >{control_plane_password} {control_plane_rules()}",
        f"user {GATEWAY_USER} on >{gateway_password} {gateway_rules()}",
    ]

"""Publication: what gateways need to decide a request locally, written to Redis
(docs/gateway-contract.md, issue 18).

The documents, each written whole in one MULTI/EXEC: `gw:v1:keys`, `gw:v1:models`,
`gw:v1:entitlements`, `gw:v1:customers`, `gw:v1:customer_tiers`, `gw:v1:reservations` and
`gw:v1:meta` (its `version` grows with every publication, so a gateway re-reads the others when
it moves); in the same transaction, the request limits admission's Lua script reads
(`adm:rl:*`, capacity.admission.limits) and the reservation floors it guarantees by
(`adm:floor:*`, capacity.admission.floors): those a sale changed, and all of them at least once
a minute. They are built from the database
by `documents.py` (the request limits by capacity.admission.limits) and written by
`publish.py`, at the end of every allocation tick and after the commit of every write that
changes them (which announce it with capacity.hooks.gateway_state_changed: the publisher
subscribes at start-up, CapacityConfig.ready). A Redis error never fails the caller: it is
logged and counted (`controlplane_gateway_publications{result="failed"}`), and the next tick
publishes again.

This package's `__init__` imports nothing: gateways import its pure module (signing.py), and
importing a submodule runs this file, which must not bring Django into a gateway.
"""

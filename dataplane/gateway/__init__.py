"""The gateway: the data plane's OpenAI-compatible front door (`python -m dataplane.gateway`).

It reads what the control plane publishes to Redis (docs/gateway-contract.md), admits every
request with the control plane's own admission scripts, routes it to the ready replica with the
least outstanding MU, and posts one usage event per request. No Django.
"""

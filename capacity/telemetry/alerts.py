"""Signed alerts to the operator's webhook (ALERT_WEBHOOK_URL, signed with
ALERT_WEBHOOK_SECRET as the webhook actuator signs: capacity.actuation.webhook): capacity at
risk (capacity.selling.at_risk), budgets (billing.budgets), a stale allocation tick
(capacity.allocation.heartbeat). Each alert is a JSON object with at least `kind` and `state`
("entered" or "left"); delivery is counted by kind (`controlplane_capacity_alerts`).
"""

from __future__ import annotations

import json
import logging

import httpx
from django.conf import settings

from capacity.actuation.webhook import signed_headers
from capacity.telemetry import metrics
from core import outbound

logger = logging.getLogger(__name__)


def send_alert(payload: dict) -> bool:
    """POST one alert to ALERT_WEBHOOK_URL, signed with ALERT_WEBHOOK_SECRET (the headers of
    capacity.actuation.webhook); a few quick tries, then it is logged and counted."""
    url = settings.ALERT_WEBHOOK_URL
    if not url:
        return False
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    for attempt in range(settings.ALERT_WEBHOOK_ATTEMPTS):
        headers = {"Content-Type": "application/json"} | signed_headers(
            settings.ALERT_WEBHOOK_SECRET, body
        )
        try:
            with outbound.client(timeout=settings.ALERT_WEBHOOK_TIMEOUT_SECONDS) as client:
                response = client.post(url, content=body, headers=headers)
            if 200 <= response.status_code < 300:
                metrics.CAPACITY_ALERTS.labels(payload["kind"], "sent").inc()
                return True
            error = f"answered {response.status_code}"
        except outbound.OutboundRefused as refused:
            error = str(refused)
            break
        except httpx.HTTPError as failure:
            error = f"{type(failure).__name__}: {failure}"
        logger.warning("capacity alert to %s, try %d: %s", url, attempt + 1, error)
    metrics.CAPACITY_ALERTS.labels(payload["kind"], "failed").inc()
    logger.error("capacity alert not delivered to %s: %s (%s)", url, error, payload)
    return False

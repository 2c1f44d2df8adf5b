"""Throttle scopes a view names in DRF's `throttle_scope` attribute; accounts.throttling counts
the requests of each. Here, below every app, so that any view may name one (controlplane's own
schema view too)."""

# Reads that build a whole document per request (an invoice's PDF or CSV, the usage CSV, the
# API's schema): counted against API_THROTTLE_EXPORTS besides the reads' limit.
EXPORTS = "exports"

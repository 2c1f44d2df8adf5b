"""`python -m dataplane.gateway`: the gateway, configured by GATEWAY_* variables only."""

from __future__ import annotations

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())

"""Container health check: exit 0 when the web process on this container answers /healthz.

Django answers 400 to a Host header outside ALLOWED_HOSTS, and a production ALLOWED_HOSTS rarely
lists 127.0.0.1, so the request connects to 127.0.0.1 but names the first allowed host.
"""

import os
import sys
import urllib.request

URL = "http://127.0.0.1:8000/healthz"


def host_header() -> str:
    hosts = [host.strip() for host in os.environ.get("ALLOWED_HOSTS", "").split(",")]
    host = next((host for host in hosts if host), "localhost")
    # ".example.com" allows example.com and its subdomains; "*" allows anything.
    host = host.lstrip(".")
    return "localhost" if host in {"", "*"} else host


def main() -> int:
    request = urllib.request.Request(URL, headers={"Host": host_header()})
    try:
        with urllib.request.urlopen(request, timeout=4) as response:  # noqa: S310 - fixed URL
            return 0 if response.status == 200 else 1
    except Exception as error:  # any failure is "unhealthy"; docker keeps the message
        print(f"unhealthy: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

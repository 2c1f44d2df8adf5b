"""`python -m dataplane.supervisor --engine NAME='argv with {port}' …`: see server.py."""

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m dataplane.traffic --client NAME=TRACE[@SCALE] …`: see replay.py."""

import sys

from .replay import main

if __name__ == "__main__":
    sys.exit(main())

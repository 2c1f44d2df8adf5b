"""python -m bench [NAME ...]: run the benchmarks (see bench/README.md)."""

import sys

from bench.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

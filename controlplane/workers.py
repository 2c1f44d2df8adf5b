"""The Celery workers and the queues each one takes: one home for `make run`
(scripts/run.sh), compose (deploy/compose.yaml) and Kubernetes (deploy/kubernetes/base/),
which tests/controlplane/test_deploy_files.py and tests/deploy/ hold to it.

- `main` takes the long work: benchmark runs (hours), what-ifs (minutes), invoices, budgets;
- `loop` takes only the allocation tick and what feeds it (usage rollups, reservation status,
  the capacity sample, the reaper of requests without an event: capacity/tasks.py): no long
  task can ever occupy it, so the tick runs on schedule while benchmarks fill `main`;
- `health` takes only the inference probes (and watches the tick's heartbeat).

Run `python -m controlplane.workers NAME` for a worker's arguments to `celery worker`.
No Django here: scripts read it before the project starts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Worker:
    queues: tuple[str, ...]
    # make run's (compose and Kubernetes size their own: more processes, not other queues)
    concurrency: int

    def arguments(self, name: str) -> list[str]:
        """Its `celery -A controlplane worker` arguments."""
        return [
            f"--queues={','.join(self.queues)}",
            f"--concurrency={self.concurrency}",
            f"--hostname={name}@%h",
        ]


WORKERS = {
    "main": Worker(queues=("default", "benchmarks"), concurrency=2),
    "loop": Worker(queues=("allocation",), concurrency=2),
    "health": Worker(queues=("health",), concurrency=1),
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in WORKERS:
        print(f"usage: python -m controlplane.workers {{{'|'.join(WORKERS)}}}", file=sys.stderr)
        return 2
    print(" ".join(WORKERS[argv[0]].arguments(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

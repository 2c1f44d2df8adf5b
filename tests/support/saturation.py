"""Keep engine replicas saturated: threads that send long completions back to back, as a
fleet's guaranteed traffic does (vLLM priority 0), until stopped. Used by the health tests
and `make bench` (bench_health)."""

from __future__ import annotations

import threading
import time

import httpx


class Saturator:
    def __init__(self, urls: list[str], *, model: str, streams_per_url: int, max_tokens: int):
        self.urls = urls
        self.model = model
        self.streams_per_url = streams_per_url
        self.max_tokens = max_tokens
        self.completed = 0
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._clients: list[httpx.Client] = []

    def __enter__(self) -> Saturator:
        for url in self.urls:
            for index in range(self.streams_per_url):
                thread = threading.Thread(target=self._loop, args=(url, index), daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        # Closing the clients cuts the requests in flight: nobody waits for a deep queue.
        for client in list(self._clients):
            client.close()
        for thread in self._threads:
            thread.join(timeout=30)

    def _loop(self, url: str, index: int) -> None:
        body = {
            "model": self.model,
            "prompt": f"saturating request {index}",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "priority": 0,
        }
        with httpx.Client(timeout=120) as client:
            with self._lock:
                self._clients.append(client)
            while not self._stop.is_set():
                try:
                    response = client.post(f"{url}/v1/completions", json=body)
                    ok = response.status_code == 200
                except Exception:  # noqa: BLE001 - a closed client ends the loop below
                    ok = False
                if self._stop.is_set():
                    return
                with self._lock:
                    if ok:
                        self.completed += 1
                    else:
                        self.errors += 1
                if not ok:
                    time.sleep(0.1)


def waiting_requests(url: str) -> float:
    """vllm:num_requests_waiting from the engine's own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:num_requests_waiting":
            return sum(sample.value for sample in family.samples)
    return 0.0

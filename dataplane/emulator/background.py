"""Run an emulator on a background thread of this process, on a free port.

For tests and benchmarks that want real HTTP without a subprocess:

    with BackgroundEmulator(config) as emulator:
        httpx.get(f"{emulator.url}/v1/models")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

from aiohttp import web

from .config import EmulatorConfig
from .fleet import Fleet
from .server import FLEET_KEY, create_app

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class BackgroundEmulator:
    def __init__(self, config: EmulatorConfig, host: str = "127.0.0.1", port: int = 0):
        self.config = config
        self.host = host
        self.port = port
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._cleanup: asyncio.Task[None] | None = None

    @property
    def fleet(self) -> Fleet:
        """The live fleet; touch it only through `call()` (it belongs to the loop's thread)."""
        assert self._app is not None
        return self._app[FLEET_KEY]

    def start(self) -> BackgroundEmulator:
        self._thread = threading.Thread(target=self._serve, name="engine-emulator", daemon=True)
        self._thread.start()
        self._started.wait(timeout=10)
        if self._error is not None:
            raise RuntimeError("the emulator failed to start") from self._error
        if not self.url:
            raise RuntimeError("the emulator did not start within 10 s")
        return self

    def call(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        """Run `fn(*args)` on the emulator's loop and return its result."""
        assert self.loop is not None

        async def _call() -> _T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(_call(), self.loop).result(timeout=10)

    def stop(self) -> None:
        if self.loop is not None and self._runner is not None:
            future = asyncio.run_coroutine_threadsafe(self._cleanup_once(), self.loop)
            future.result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> BackgroundEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _cleanup_once(self) -> None:
        assert self._runner is not None
        if self._cleanup is None:
            self._cleanup = asyncio.ensure_future(self._runner.cleanup())
        await self._cleanup

    def _crash(self) -> None:
        """An injected crash must not exit the test process: stop serving instead."""
        if self._cleanup is None and self._runner is not None:
            self._cleanup = asyncio.ensure_future(self._runner.cleanup())

    async def _setup(self) -> None:
        self._app = create_app(self.config, crash=self._crash)
        self._runner = web.AppRunner(
            self._app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096)
        await site.start()
        # With port 0 the OS picks the port; read back which one.
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

"""The link to a remote OpenAI-compatible server (runtime.backend remote): the official async `openai` client on
one event-loop thread, and a circuit breaker. remote.breaker_failures link failures in a row (no connection, a
timeout before the first piece, a 5xx) open the circuit: while open, a request is answered at once (or by the
fallback) and a background probe asks GET /v1/models every remote.probe_interval_s; the first answer that lists
remote.model closes it. state() is what /diagnostics and /metrics show."""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import openai

from spec_edge.config import ConfigError, RemoteSection


class Link:
    """The client, the loop it runs on, the breaker. run(coro) -> a concurrent Future (cancel() cancels the task:
    the HTTP stream is closed, which the server sees as a client gone)."""

    def __init__(self, cfg: RemoteSection):
        self.cfg = cfg
        key = cfg.api_key or os.environ.get(cfg.api_key_env, "")
        self.client = openai.AsyncOpenAI(base_url=cfg.base_url, api_key=key or "none", max_retries=0,
                                         timeout=openai.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="spec_edge-remote", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self.open = False            # the circuit: True while the server is taken as down
        self.in_row = 0              # link failures in a row
        self.errors = 0              # link failures in all
        self.requests = 0            # requests the server answered to the end
        self.last_error = ""
        self.first_token_s = 0.0     # the last request's time to its first piece
        self._probe: Future | None = None

    def run(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def check(self) -> str | None:
        """At configure: None when the server answers and lists remote.model; why, when it does not answer;
        ConfigError when it answers without the model."""
        try:
            ids = self.run(self._models()).result(self.cfg.connect_timeout_s + self.cfg.first_token_timeout_s)
        except Exception as err:  # noqa: BLE001 - every failure is the reason to report
            return (f"remote.base_url {self.cfg.base_url} does not answer GET /models ({type(err).__name__}: {err}): "
                    "start the server, or fix remote.base_url / remote.api_key")
        if self.cfg.model not in ids:
            raise ConfigError(f"the server at {self.cfg.base_url} does not serve remote.model {self.cfg.model!r}; it "
                              f"lists {', '.join(ids) or 'no model'}: set remote.model to one of those")
        return None

    async def _models(self) -> list[str]:
        return [model.id async for model in self.client.models.list()]

    def succeeded(self, first_token_s: float) -> None:
        with self._lock:
            self.in_row, self.first_token_s = 0, first_token_s
            self.requests += 1

    def failed(self, reason: str, down: bool = False) -> None:
        """A link failure (counted; the circuit opens after remote.breaker_failures in a row, or now: down)."""
        with self._lock:
            self.in_row += 1
            self.errors += 1
            self.last_error = reason
            if (down or self.in_row >= self.cfg.breaker_failures) and not self.open:
                self.open = True
                self._probe = self.run(self._probing())

    async def _probing(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            try:
                if self.cfg.model in await asyncio.wait_for(self._models(), self.cfg.connect_timeout_s):
                    with self._lock:
                        self.open, self.in_row = False, 0
                    return
            except Exception as err:  # noqa: BLE001 - still down: probe again
                self.last_error = f"probe: {type(err).__name__}: {err}"

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"base_url": self.cfg.base_url, "kind": self.cfg.kind, "state": "open" if self.open else "closed",
                    "up": not self.open, "failures_in_row": self.in_row, "errors": self.errors,
                    "requests": self.requests, "first_token_s": round(self.first_token_s, 4),
                    "last_error": self.last_error, "fallback": self.cfg.fallback or "none"}

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        self.run(self.client.close()).result(2.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(2.0)

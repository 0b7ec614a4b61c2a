"""A second `spec-edge http` process on loopback: the server runtime.backend remote talks to in the tests
(test_remote.py, ros/test_node_remote.py), stopped and started again on the same port."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from spec_edge import config as cfgmod

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`spec-edge http --config <cfg with http.port>` in a process of its own."""

    def __init__(self, cfg: cfgmod.Config, folder: Path):
        self.port = free_port()
        self.profile = folder / "remote.yaml"
        self.profile.write_text(cfgmod.dump(cfg.replace(**{"http.port": self.port})))
        self.log = folder / "remote.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
        self.proc = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", "http", "--config", str(self.profile)],
                                     env=env, stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the remote did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def metric(self, name: str) -> float:
        return self.metrics(name)[0]

    def metrics(self, *names: str) -> list[float]:
        """The values of these /metrics lines, read at once (0 for a counter not counted yet)."""
        text = httpx.get(f"{self.url}/metrics", timeout=2).text
        found = [re.search(rf"^{re.escape(name)} (\S+)$", text, re.M) for name in names]
        return [float(f.group(1)) if f else 0.0 for f in found]

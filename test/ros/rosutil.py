"""Helpers of the ROS 2 tests: process environments, the server process, client processes."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("_client.py")


# Fast DDS's default ports for domain d start at 7400 + 250 d; ids above 101 can reach Linux's ephemeral ports
# (32768+), so ROS 2 names 0-101 the safe range. 0 is every ROS machine's default domain: never a test's.
DOMAIN_IDS = range(1, 102)
DOMAIN_LOCKS = Path(os.environ.get("SPEC_EDGE_DOMAIN_LOCK_DIR", "/tmp"))
_claimed: dict[str, tuple[int, int]] = {}  # name -> (domain id, the fd of its held lock)


def domain_id_for(name: str) -> int:
    """The ROS_DOMAIN_ID of one test module (name) in this process: its own, shared with no other module of this
    run and no other process on this host that claims ids the same way, for the life of this process.

    Claimed by an exclusive lock (fcntl.flock, LOCK_NB) on DOMAIN_LOCKS/spec_edge_ros_domain_<id>.lock, trying the
    ids of DOMAIN_IDS in order; the kernel drops the lock when this process ends, however it ends, so no stale
    claim outlives a run. The lock's fd is not inherited (PEP 446): a child process runs on the id its parent
    holds. The id of the environment this run started in (an outer ROS_DOMAIN_ID: the developer's robot, CI's
    own) is skipped, so the tests' nodes never join that graph."""
    if name in _claimed:
        return _claimed[name][0]
    outer = os.environ.get("ROS_DOMAIN_ID", "")
    for domain_id in DOMAIN_IDS:
        if str(domain_id) == outer.strip():
            continue
        try:
            fd = os.open(DOMAIN_LOCKS / f"spec_edge_ros_domain_{domain_id}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError:
            continue  # another user's lock file this user cannot open: theirs
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _claimed[name] = (domain_id, fd)
        return domain_id
    raise RuntimeError(f"no free ROS domain id in {DOMAIN_IDS.start}-{DOMAIN_IDS.stop - 1}: other test runs on this "
                       f"host hold them all (locks {DOMAIN_LOCKS}/spec_edge_ros_domain_<id>.lock); wait for one to end")


# A node's exit after SIGINT / SIGTERM while idle (rclpy shut down, its DDS participant gone, the interpreter
# ended). The bound is what a robot's launch allows: ros2 launch sends SIGINT, then SIGTERM after sigterm_timeout
# (default 5 s: launch/actions/execute_local.py, ExecuteLocal.__init__), so a node slower than that is not shut
# down but signalled again. Server.stop sends SIGKILL at its timeout (this, by default); the exit code says so.
IDLE_EXIT_S = 5.0
# Fast DDS's default lease: a participant that leaves without saying so stays in the graph this long.
DDS_LEASE_S = 20.0


def exit_limit(idle_exit_s: float) -> float:
    """The bound on a node's exit after a signal while it works (generating, exporting), from its idle exit
    measured in the same run (the machine's load is in both): 3x that, at least 2 s. What it tells apart: an
    exit that waits for the work to end (a 900-token generation, a first start's export: tens of seconds)."""
    return max(2.0, 3.0 * idle_exit_s)


def ros_env(domain_id: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(domain_id),
               PYTHONUNBUFFERED="1", RCUTILS_COLORIZED_OUTPUT="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def write_params(path: Path, params: dict) -> Path:
    """A ROS 2 parameters file from flat 'section.field' keys."""
    tree: dict = {}
    for key, value in params.items():
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": tree}}))
    return path


class Server:
    """The node in its own process (`spec-edge serve --params FILE`)."""

    def __init__(self, env: dict[str, str], params_file: Path, log_path: Path, argv: list[str] | None = None):
        self.env, self.params_file, self.log_path = env, params_file, log_path
        self.argv = argv or [sys.executable, "-m", "spec_edge.cli", "serve", "--params", str(params_file)]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0, ready: str = "serving") -> "Server":
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready in self.log():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not serving within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = IDLE_EXIT_S) -> float:
        """Signal the server; returns the seconds it took to exit (SIGKILL after timeout)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        took = time.monotonic() - started
        self._log.close()
        return took


def start_client(env: dict[str, str], job: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CLIENT), json.dumps(job)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_client(proc: subprocess.Popen, timeout: float = 300.0):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"client timed out; stderr:\n{err}")
    assert proc.returncode == 0, f"client failed ({proc.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def run_client(env: dict[str, str], job: dict, timeout: float = 300.0):
    return finish_client(start_client(env, job), timeout)


def test_params(**overrides) -> dict:
    """The test servers' parameters: the embedded default in fp32 with one slot and a fixed k=4 (the default profile
    runs q4 over 4 slots with k auto, whose choices follow live call timings: a node's stats would not equal the
    in-process engine's; test_node_batch.py serves slots), graphs cached in the repo's engines/."""
    params = {"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32", "graphs.batch_slots": 1,
              "speculative.k": 4}
    params.update(overrides)
    return params


test_params.__test__ = False  # a helper, not a test


def engine_request(**fields):
    """An engine.GenerateRequest from the same plain fields the clients send."""
    from spec_edge.runtime.requests import GenerateRequest, Tool
    fields = dict(fields)
    fields["messages"] = tuple(tuple(m) for m in fields.get("messages", ()))
    fields["tools"] = tuple(Tool(**t) for t in fields.get("tools", ()))
    fields["stop"] = tuple(fields.get("stop", ()))
    if fields.get("drafter") == "":
        fields["drafter"] = None
    return GenerateRequest(**fields)

"""The ROS tests' DDS domain ids (test/ros/rosutil.domain_id_for): one per test module, never shared with another
module of the run nor with another run on this host while it holds it, never the outer ROS_DOMAIN_ID, and free
again once the process that held it ends. Needs no rclpy: the ids are claimed with lock files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ros"))
import rosutil  # noqa: E402

CLAIM = """
import json, sys
sys.path.insert(0, sys.argv[1])
import rosutil
print(json.dumps([rosutil.domain_id_for(name) for name in sys.argv[2:]]), flush=True)
sys.stdin.read()  # hold the ids until the parent closes stdin
"""


@pytest.fixture
def locks(tmp_path, monkeypatch):
    monkeypatch.setattr(rosutil, "DOMAIN_LOCKS", tmp_path)
    monkeypatch.setattr(rosutil, "_claimed", {})
    monkeypatch.setenv("ROS_DOMAIN_ID", "1")  # the outer graph's id: never a test module's
    yield tmp_path
    for _, fd in rosutil._claimed.values():
        os.close(fd)


def other_run(locks: Path, *names: str) -> tuple[subprocess.Popen, list[int]]:
    """Another test run on this host (a process of its own) claiming ids for its modules; it holds them until
    its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", CLAIM, str(Path(__file__).parent / "ros"), *names],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, SPEC_EDGE_DOMAIN_LOCK_DIR=str(locks), ROS_DOMAIN_ID=""))
    return proc, json.loads(proc.stdout.readline())


def test_each_module_and_each_run_has_its_own_domain(locks):
    first, second = rosutil.domain_id_for("test_a"), rosutil.domain_id_for("test_b")
    assert (first, second) == (2, 3)  # 1 is the outer ROS_DOMAIN_ID
    assert rosutil.domain_id_for("test_a") == first  # a module keeps its id
    proc, theirs = other_run(locks, "test_a", "test_b")  # the same module names in a second run
    assert theirs == [1, 4]  # its outer id is unset: 1 is free to it; 2 and 3 are held here
    proc.stdin.close()
    proc.wait(timeout=60)
    assert rosutil.domain_id_for("test_c") == 4  # free again once the process that held it ended
    assert all(1 <= i <= 101 for i in (first, second, *theirs))  # Fast DDS's safe range


def test_no_free_domain_says_so(locks, monkeypatch):
    monkeypatch.setattr(rosutil, "DOMAIN_IDS", range(1, 3))
    assert rosutil.domain_id_for("test_a") == 2
    with pytest.raises(RuntimeError, match="no free ROS domain id in 1-2"):
        rosutil.domain_id_for("test_b")

"""Fixtures of the ROS 2 tests: real rclpy, real DDS (Fast DDS on loopback), separate processes.

Every process these tests start gets ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and a ROS_DOMAIN_ID of
its test module's own (rosutil.domain_id_for: claimed with a lock file, so no other module of the run and no
other run on this host has it, and never the outer ROS_DOMAIN_ID), so no DDS traffic leaves the machine and
parallel runs do not meet.
The tests skip, saying why, where rclpy or spec_edge_interfaces does not import: scripts/setup_ros.sh
installs both (.ci/run runs it).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Before anything here could create a ROS context: discovery stays on this machine.
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"

from rosutil import REPO, Server, domain_id_for, ros_env, test_params, write_params  # noqa: E402

MAKING = ("[export]", "[fused]", "[q4]", "[q8]", "[packed]")  # progress lines of a graph being made (artifacts.py)


def _ros_missing() -> str | None:
    try:
        import rclpy  # noqa: F401
    except ImportError as err:
        return f"rclpy is not importable ({err}); run scripts/setup_ros.sh"
    try:
        import spec_edge_interfaces.action  # noqa: F401
        import spec_edge_interfaces.srv  # noqa: F401
    except ImportError as err:
        return f"spec_edge_interfaces is not built ({err}); run scripts/setup_ros.sh"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _ros_missing()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def module_env(request) -> dict[str, str]:
    return ros_env(domain_id_for(request.module.__name__))


@pytest.fixture(scope="module")
def server_factory(module_env, tmp_path_factory):
    """Start servers for a module; all are stopped (SIGTERM, then SIGKILL) when the module ends."""
    started: list[Server] = []
    tmp = tmp_path_factory.mktemp("ros_server")

    def start(params: dict, name: str = "server") -> Server:
        server = Server(module_env, write_params(tmp / f"{name}.yaml", params), tmp / f"{name}.log")
        started.append(server)
        server.start()
        made = [line for line in server.log().splitlines() if any(mark in line for mark in MAKING)]
        if params.get("runtime.engine_dir") == str(REPO / "engines") and made:
            pytest.fail(f"the node made graphs in <repo>/engines that the session should have made first: mark the "
                        f"module real_model(<its form>) (test/real_forms.py REAL_FORMS):\n" + "\n".join(made[:5]))
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference_engine():
    """The core, in this process, with the configuration the test servers use: the expected answers."""
    from spec_edge import config as cfgmod
    from spec_edge import artifacts
    engine = artifacts.engine(cfgmod.from_params(test_params()))
    yield engine
    engine.close()

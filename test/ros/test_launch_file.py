"""launch/llm.launch.py runs: generate_launch_description() against the real launch / launch_ros where they
import (a ROS 2 machine), else against the stand-in built from their pinned source (test/launch_api.py,
fixtures/launch_api.json); either way the file's arguments, parameters file and node are checked. Only the
missing packages are caught: a launch file that raises fails here."""
from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest
import yaml

import launch_api
from spec_edge import config as cfgmod

REPO = Path(__file__).resolve().parents[2]
ARGUMENTS = {"params_file", "namespace", "managed", "autostart", "http"}


@pytest.fixture
def installed_share(tmp_path, monkeypatch):
    """An ament prefix where spec_edge is installed as colcon installs it (ros/spec_edge/setup.py's data_files:
    the package marker, share/spec_edge/config and launch); AMENT_PREFIX_PATH points at it."""
    share = tmp_path / "share"
    (share / "ament_index" / "resource_index" / "packages").mkdir(parents=True)
    (share / "ament_index" / "resource_index" / "packages" / "spec_edge").write_text("")
    (share / "spec_edge").mkdir()
    (share / "spec_edge" / "config").symlink_to(REPO / "config")
    (share / "spec_edge" / "launch").symlink_to(REPO / "launch")
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(tmp_path))
    return share / "spec_edge"


def launch_modules(monkeypatch) -> bool:
    """True with the real launch / launch_ros (their signatures checked against the pin), False with the
    stand-in installed in sys.modules."""
    try:
        import launch  # noqa: F401
        import launch.actions  # noqa: F401 (the repo's launch/ folder alone is a namespace package without it)
        import launch_ros.actions  # noqa: F401
    except ImportError:
        for name in [m for m in sys.modules if m == "launch" or m.startswith(("launch.", "launch_ros"))]:
            monkeypatch.delitem(sys.modules, name)
        for name, module in launch_api.standin_modules().items():
            monkeypatch.setitem(sys.modules, name, module)
        return False
    api = json.loads(launch_api.FIXTURE.read_text())["api"]
    for name, entry in api.items():
        real = getattr(importlib.import_module(entry["module"]), name)
        params = entry["init"] if entry["kind"] == "class" else entry["params"]
        if params is not None:
            want = launch_api.signature(params)
            got = inspect.signature(real.__init__ if entry["kind"] == "class" else real)
            got = [(p.name, p.kind) for p in got.parameters.values() if p.name != "self"]
            assert got == [(p.name, p.kind) for p in want.parameters.values()], f"{name}: the pin is stale"
    return True


def run_launch_file():
    spec = importlib.util.spec_from_file_location("llm_launch", REPO / "launch" / "llm.launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate_launch_description()  # no except: a launch file that raises fails the test


def test_launch_file_declares_arguments_params_file_and_node(installed_share, monkeypatch):
    real = launch_modules(monkeypatch)
    description = run_launch_file()
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
    from launch_ros.actions import LifecycleNode, Node
    from lifecycle_msgs.msg import Transition

    assert isinstance(description, LaunchDescription)
    if real:  # the real classes keep their arguments privately: the structure is what can be checked
        arguments = {e.name for e in description.entities if isinstance(e, DeclareLaunchArgument)}
        assert arguments == ARGUMENTS
        nodes = [e for e in description.entities if isinstance(e, Node)]
        assert len(nodes) == 2 and sum(isinstance(n, LifecycleNode) for n in nodes) == 1
        return
    entities = description.given["initial_entities"]
    declared = {e.given["name"]: e.given for e in entities if isinstance(e, DeclareLaunchArgument)}
    assert set(declared) == ARGUMENTS
    # the default parameters file: installed under share/spec_edge/config, a profile the node reads
    default = Path(declared["params_file"]["default_value"])
    assert default.parent == installed_share / "config" and default.is_file(), default
    assert "ros__parameters" in yaml.safe_load(default.read_text())["/**"]
    cfgmod.load(default)  # every key known (a typo is refused with the key's name)
    assert declared["managed"]["default_value"] == "false" and declared["autostart"]["default_value"] == "true"
    assert declared["managed"]["choices"] == declared["autostart"]["choices"] == ["true", "false"]
    assert declared["http"]["default_value"] == "false" == str(cfgmod.HttpSection.enabled).lower()

    def config_name(substitution):
        return substitution.given["variable_name"]

    nodes = [e for e in entities if isinstance(e, Node)]
    assert len(nodes) == 2
    lifecycle = next(n for n in nodes if isinstance(n, LifecycleNode))
    plain = next(n for n in nodes if not isinstance(n, LifecycleNode))
    for node in nodes:  # the generate_server executable of ros/spec_edge/setup.py, named spec_edge
        g = node.given
        assert (g["package"], g["executable"], g["name"]) == ("spec_edge", "generate_server", "spec_edge")
        params_file, http = g["parameters"]  # http:=true sets http.enabled over the params file's
        assert config_name(params_file) == "params_file" and config_name(http["http.enabled"]) == "http"
        assert config_name(g["namespace"]) == "namespace"
    assert "generate_server = spec_edge.ros2.node:main" in (REPO / "ros" / "spec_edge" / "setup.py").read_text()
    # managed:=false runs the self-configuring node, managed:=true the LifecycleNode that waits (--no-autostart)
    assert type(plain.given["condition"]).__name__ == "UnlessCondition"
    assert type(lifecycle.given["condition"]).__name__ == "IfCondition"
    assert config_name(plain.given["condition"].given["predicate_expression"]) == "managed"
    assert config_name(lifecycle.given["condition"].given["predicate_expression"]) == "managed"
    assert lifecycle.given["arguments"] == ["--no-autostart"]
    # with managed and autostart: configure emitted at start, activate once the node is inactive (once only:
    # a lifecycle manager's later cleanup -> configure -> activate must not meet a second activate)
    emitted = [e for e in entities if isinstance(e, EmitEvent)]
    assert [e.given["event"].given["transition_id"] for e in emitted] == [Transition.TRANSITION_CONFIGURE]
    handlers = [e.given["event_handler"] for e in entities if isinstance(e, RegisterEventHandler)]
    (handler,) = [h for h in handlers if type(h).__name__ == "OnStateTransition"]
    assert handler.given["target_lifecycle_node"] is lifecycle and handler.given["handle_once"] is True
    assert handler.given["goal_state"] == "inactive"
    (activate,) = handler.given["entities"]
    assert activate.given["event"].given["transition_id"] == Transition.TRANSITION_ACTIVATE
    assert activate.given["event"].given["lifecycle_node_matcher"] == ("matches_action", {"target_action": lifecycle})
    # the params file checked before the nodes; a node process that ends non-zero ends the launch (both run under
    # the real launch below)
    from launch.actions import OpaqueFunction
    (check,) = [i for i, e in enumerate(entities) if isinstance(e, OpaqueFunction)]
    assert check < min(entities.index(n) for n in nodes)
    (exited,) = [h for h in handlers if type(h).__name__ == "OnProcessExit"]
    assert exited.given["target_action"](plain) and exited.given["target_action"](lifecycle)


def test_standin_refuses_what_the_real_api_refuses():
    """The stand-in is only as good as its pin: an argument the real __init__ lacks raises TypeError."""
    modules = launch_api.standin_modules()
    with pytest.raises(TypeError):
        modules["launch_ros.actions"].Node(executable="x", no_such_argument=1)
    with pytest.raises(TypeError):
        modules["launch.actions"].DeclareLaunchArgument()  # name is required
    node = modules["launch_ros.actions"].Node(executable="x", output="screen", condition=None, additional_env={})
    assert node.given["output"] == "screen" and "additional_env" in node.given


# -- the real launch file under the real launch (a ROS 2 machine, or launch / launch_ros built from their source:
# docs/testing.md, "The launch file"), as `ros2 launch spec_edge llm.launch.py ARG:=VALUE` runs it

LAUNCH = """
import sys
from launch import LaunchService
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource

service = LaunchService()
service.include_launch_description(IncludeLaunchDescription(
    PythonLaunchDescriptionSource(sys.argv[1]), launch_arguments=[a.split(":=", 1) for a in sys.argv[2:]]))
sys.exit(service.run())
"""


@pytest.fixture
def real_launch(installed_share, module_env):
    """ros2 launch spec_edge llm.launch.py ARG:=VALUE ... -> (exit status, output): the installed prefix of
    installed_share with generate_server in lib/spec_edge (as colcon installs it), this checkout's spec_edge."""
    try:
        import launch.actions  # noqa: F401
        import launch_ros.actions  # noqa: F401
    except ImportError as err:
        pytest.skip(f"launch / launch_ros do not import ({err}): build them from github.com/ros2/launch and "
                    "github.com/ros2/launch_ros (docs/testing.md, \"The launch file\")")
    import os
    import signal
    import subprocess

    prefix = installed_share.parents[1]
    server = prefix / "lib" / "spec_edge" / "generate_server"
    server.parent.mkdir(parents=True)
    server.write_text(f"#!{sys.executable}\nimport sys\nfrom spec_edge.ros2.node import main\nsys.exit(main())\n")
    server.chmod(0o755)
    env = dict(module_env, AMENT_PREFIX_PATH=str(prefix), PYTHONPATH=os.pathsep.join(sys.path))

    def run(*arguments: str, timeout: float = 120) -> tuple[int, str]:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(installed_share / "launch" / "llm.launch.py"),
                                 *arguments], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a launch that serves instead of failing: it and its node go
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(f"the launch still ran after {timeout} s:\n{output}") from None
        return proc.returncode, output

    return run


def test_launch_refuses_a_params_file_that_is_not_there(real_launch, tmp_path):
    """launch_ros alone only warns ("Parameter file path is not a file") and starts the node on its defaults: the
    embedded default profile would serve instead of the one asked for."""
    missing = tmp_path / "profiles" / "no_such_file.yaml"
    status, output = real_launch(f"params_file:={missing}")
    assert status == 1, output
    assert f"params_file:={missing} does not exist" in output and "the node was not started" in output, output
    assert "process started" not in output, output  # refused before any node started
    status, output = real_launch(f"params_file:={tmp_path}")  # a folder
    assert status == 1 and "is not a file" in output, output


@pytest.mark.parametrize("managed", ["false", "true"])
def test_a_node_that_fails_makes_the_launch_fail(real_launch, tmp_path, managed):
    """A node process that exits non-zero ends the launch with status 1 and the reason, so a supervisor watching
    the launch sees it: unmanaged, an unknown key in the params file (refused at configure, the process exits 1);
    managed (a failed configure leaves a lifecycle node up, unconfigured, for its manager), a params file rcl
    cannot parse (the process fails as it starts)."""
    params = tmp_path / "typo.yaml"
    params.write_text("/**:\n  ros__parameters:\n    speculative:\n      drafterr: none\n")
    if managed == "true":
        params.write_text("/**:\n  ros__parameters: [not, a, mapping\n")
    status, output = real_launch(f"params_file:={params}", f"managed:={managed}")
    assert status == 1, output
    assert "the spec_edge node exited with status" in output, output

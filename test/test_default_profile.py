"""One default (issue 38): every entry point given no profile runs the same configuration, Config() (the defaults
written in spec_edge/config.py): `ros2 launch spec_edge llm.launch.py` (its params file), `spec-edge serve` (the
node's parameters with no params file), `spec-edge generate / bench / tune / export`, scripts/demo.sh and
scripts/soak.py. A default changed in one place only fails here."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import shlex
from pathlib import Path

import pytest

from spec_edge import cli
from spec_edge import config as cfgmod
from spec_edge.config import Config

REPO = Path(__file__).resolve().parents[1]


def launch_default_params() -> Path:
    """The params file launch/llm.launch.py passes when params_file is not given, read from its source (launch_ros
    is not needed): DeclareLaunchArgument("params_file", default_value=NAME) with NAME =
    os.path.join(get_package_share_directory("spec_edge"), *parts), the installed copy of this checkout's
    config/ (ros/spec_edge/setup.py installs config/*.yaml into share/spec_edge/config)."""
    tree = ast.parse((REPO / "launch" / "llm.launch.py").read_text())
    declared = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and ast.unparse(node.func) == "DeclareLaunchArgument" and node.args
                and ast.literal_eval(node.args[0]) == "params_file"]
    assert len(declared) == 1, "launch/llm.launch.py declares params_file once"
    default, = [kw.value for kw in declared[0].keywords if kw.arg == "default_value"]
    assigned = {target.id: node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    join = assigned[default.id] if isinstance(default, ast.Name) else default
    assert ast.unparse(join.func) == "os.path.join", ast.unparse(join)
    share, *parts = join.args
    assert ast.unparse(share) == "get_package_share_directory('spec_edge')", ast.unparse(join)
    return REPO.joinpath(*(ast.literal_eval(part) for part in parts))


def cli_config(argv: list[str]) -> Config:
    """The configuration `spec-edge <argv>` runs."""
    return cli.config_from_args(cli.build_parser().parse_args(argv))


def demo_argv() -> list[str]:
    """The spec-edge command line scripts/demo.sh runs (its prompt as given)."""
    lines = [line for line in (REPO / "scripts" / "demo.sh").read_text().splitlines()
             if "spec-edge generate" in line and not line.lstrip().startswith("#")]
    assert len(lines) == 1, lines
    program, *argv = shlex.split(lines[0].replace('"$prompt"', "'a prompt'"))
    assert program == ".venv/bin/spec-edge", program
    return argv


def soak_params() -> Path:
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    return soak.DEFAULT_PARAMS


def test_every_entry_point_without_options_resolves_the_default_profile():
    default = Config()
    resolved = {
        "ros2 launch spec_edge llm.launch.py": cfgmod.load(launch_default_params()),
        "spec-edge generate": cli_config(["generate", "--prompt", "hi"]),
        "spec-edge bench": cli_config(["bench"]),
        "spec-edge bench --guided": cli_config(["bench", "--guided"]),
        "spec-edge export": cli_config(["export"]),
        "scripts/demo.sh": cli_config(demo_argv()),
        "scripts/soak.py": cfgmod.load(soak_params()),
    }
    defaults = cfgmod.to_params(default)
    differ = {name: {key: value for key, value in cfgmod.to_params(cfg).items() if defaults[key] != value}
              for name, cfg in resolved.items() if cfg != default}
    assert not differ, f"entry points that run another configuration than Config(): {differ}"


def test_the_default_names_itself_in_generate():
    args = cli.build_parser().parse_args(demo_argv())
    assert cli.answered_by(args, cli.config_from_args(args)) == {"profile": "default", "weights": "q4"}


@pytest.mark.parametrize("params_file", [None, "launch"], ids=["spec-edge serve", "launch params_file"])
def test_the_node_resolves_the_default_profile(params_file):
    """The node as `spec-edge serve` starts it with no options (no params file), and with the launch file's
    params file: the configuration its configure transition reads is Config(). In this process, not configured
    (no engine), in a ROS context of its own."""
    rclpy = pytest.importorskip("rclpy")
    pytest.importorskip("spec_edge_interfaces.srv")
    from spec_edge.ros2 import node as node_mod

    ros_args = ["--ros-args", "--params-file", str(launch_default_params())] if params_file else []
    context = rclpy.Context()
    rclpy.init(args=["spec_edge", *ros_args], context=context)
    try:
        node = node_mod.GenerateNode(context=context)
        try:
            resolved = cfgmod.from_params({**node._current_params(), **node._unknown_overrides()})  # as configure
        finally:
            node.destroy_node()
    finally:
        rclpy.shutdown(context=context)
    assert resolved == Config(), [f.name for f in dataclasses.fields(Config)
                                  if getattr(resolved, f.name) != getattr(Config(), f.name)]

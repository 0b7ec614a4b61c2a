"""colcon in a workspace whose src/ holds this repository: both packages found, built, installed, run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rosutil import IDLE_EXIT_S, REPO, Server, domain_id_for, ros_env, run_client

VENV_BIN = Path(sys.executable).parent
COLCON = VENV_BIN / "colcon"

# the release tier (docs/testing.md): a packaging check, minutes of colcon build
pytestmark = [pytest.mark.release, pytest.mark.real_model("default")]


def copy_working_tree(dest: Path) -> None:
    """What a clone holds: tracked and not-ignored files, links kept as links."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        src, dst = REPO / name, dest / name
        if not (src.exists() or src.is_symlink()):
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    if not COLCON.exists():
        pytest.skip(f"colcon is not installed in {VENV_BIN}; run scripts/setup.sh --colcon")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    ws = tmp_path_factory.mktemp("ws")
    copy_working_tree(ws / "src" / "spec_edge")
    return ws


def colcon_env() -> dict[str, str]:
    venv = str(VENV_BIN.parent)
    env = dict(os.environ)
    # the ROS underlay is the venv (PyPI wheels); on a robot it is /opt/ros/jazzy
    env.update(AMENT_PREFIX_PATH=venv, CMAKE_PREFIX_PATH=venv,
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    return env


def test_colcon_discovers_builds_and_installs_both_packages(workspace):
    env = colcon_env()
    listed = subprocess.run([str(COLCON), "list", "--names-only"], cwd=workspace, env=env,
                            capture_output=True, text=True, check=True).stdout.split()
    assert sorted(listed) == ["spec_edge", "spec_edge_interfaces"], listed

    build = subprocess.run(
        [str(COLCON), "build", "--event-handlers", "console_cohesion+", "--cmake-args",
         f"-DPython3_EXECUTABLE={sys.executable}", "-DBUILD_TESTING=OFF"],
        cwd=workspace, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-6000:] + build.stderr[-3000:]

    install = workspace / "install"
    share = install / "spec_edge" / "share" / "spec_edge"
    for path in (install / "spec_edge" / "lib" / "spec_edge" / "generate_server",   # ros2 run finds it here
                 share / "launch" / "llm.launch.py",
                 share / "config" / "default.yaml",
                 share / "package.xml",
                 install / "spec_edge" / "share" / "ament_index" / "resource_index" / "packages" / "spec_edge",
                 install / "spec_edge_interfaces" / "share" / "spec_edge_interfaces" / "srv" / "Generate.srv",
                 install / "spec_edge_interfaces" / "share" / "spec_edge_interfaces" / "action" / "Generate.action"):
        assert path.exists(), f"colcon did not install {path.relative_to(workspace)}"

    # the installed packages import from the install space, not from the source tree or the venv
    where = subprocess.run(
        ["bash", "-c", "source install/setup.bash && python -c 'import spec_edge, spec_edge_interfaces.srv as s; "
                       "print(spec_edge.__file__); print(s.__file__)'"],
        cwd=workspace, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(p.startswith(str(install)) for p in where), where


def test_installed_executable_serves_with_installed_default_profile(workspace, tmp_path):
    install = workspace / "install"
    if not (install / "setup.bash").exists():
        pytest.skip("the colcon build test did not run or failed")
    env = colcon_env()  # a copy of os.environ: the ROS settings must come after it, or an outer
    env.update(ros_env(domain_id_for(__name__)))  # ROS_DOMAIN_ID (CI sets one) wins over the test's
    env.pop("PYTHONPATH", None)
    share = install / "spec_edge" / "share" / "spec_edge"
    command = (f"source {install}/setup.bash && exec {install}/spec_edge/lib/spec_edge/generate_server "
               f"--ros-args --params-file {share}/config/default.yaml -p runtime.engine_dir:={REPO / 'engines'}")
    server = Server(env, share / "config" / "default.yaml", tmp_path / "installed.log",
                    argv=["bash", "-c", command]).start()
    try:
        answer, = run_client(ros_env(domain_id_for(__name__)),
                             {"mode": "call", "wait": 600.0,  # a fresh clone's server exports first
                              "requests": [{"prompt": "Say hi.", "max_new_tokens": 4}]})
        assert answer["success"], answer["message"]
        assert answer["num_tokens"] >= 1
    finally:
        took = server.stop()
    assert server.proc.returncode == 0 and took < IDLE_EXIT_S, (took, server.log()[-2000:])

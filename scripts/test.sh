#!/usr/bin/env bash
# README command 2: set up everything the tests need (core + ROS 2 wheels + spec_edge_interfaces)
# into .venv, then run the test suite but its release tier (CI's run). Extra arguments go to pytest:
# `scripts/test.sh --release` runs the release tier too (docs/testing.md, "Tiers") and installs colcon for it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
setup=(--ros)
for arg in "$@"; do [ "$arg" = --release ] && setup+=(--colcon); done  # test_colcon.py (release tier) runs colcon
"$repo/scripts/setup.sh" "${setup[@]}"
cd "$repo"
# DDS discovery stays on this machine. The tests' ROS processes run on ids their modules claim
# (test/ros/rosutil.py domain_id_for), never on this outer one, which they skip.
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-57}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" test

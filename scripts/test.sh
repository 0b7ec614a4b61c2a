#!/usr/bin/env bash
# README command 2: set up everything the tests need (core + ROS 2 wheels + spec_edge_interfaces)
# into .venv, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup.sh" --ros
cd "$repo"
# DDS discovery stays on this machine; a domain id of the test run's own.
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-57}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" test

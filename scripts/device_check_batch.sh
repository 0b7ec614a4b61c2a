#!/usr/bin/env bash
# One-shot device check of TensorRT with graphs.batch_slots > 1 (in-flight batching), for a Jetson AGX Thor
# (JetPack 7, TensorRT 10.13) or a discrete GPU with TensorRT 10.x Python bindings and CUDA torch.
# Everything it checks was built and tested without a GPU (test/test_trt_batch.py); this runs what needs one:
#   1. env     tensorrt / torch / GPU versions (stops here, saying what is missing)
#   2. api     test/test_tensorrt_api.py (every TensorRT call of trt_batch.py against the installed bindings)
#   3. device  test/test_trt_batch_device.py: build the embedded SmolLM2 batched engine (B = 4, float16),
#              profiles carry the rows; every subset's rows == ONNX Runtime float32 (near-tie rule); CUDA
#              graphs == eager bit for bit; a row alone vs in four rows; requests joining / leaving == alone
#   4. time    scripts/measure_batch_trt.py: (n, 1) / (n, 5) calls for n = 1..4, idle rows, eager vs
#              graphed, a prefill chunk, and the B=1 engine's step / verify beside them
# Usage (from the checkout, in a venv made with --system-site-packages so `import tensorrt` works):
#   scripts/device_check_batch.sh            # all stages, ~5-8 minutes on a discrete GPU (two small builds)
#   STAGES="device time" scripts/device_check_batch.sh
# Output: $OUT (default /tmp/spec_edge_device_check_batch; $OUT of the lent machines comes back): env.txt,
# pytest_api.txt, pytest_device.txt, timing.txt, timing.json; the engines stay in $OUT/engines for a rerun.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-/tmp/spec_edge_device_check_batch}
STAGES=${STAGES:-"env api device time"}
mkdir -p "$OUT"
export PYTHONPATH=$PWD ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-82}
export SPEC_EDGE_BATCH_ENGINE_DIR=${SPEC_EDGE_BATCH_ENGINE_DIR:-$OUT/engines}
status=0

run() {  # run NAME CMD...: the command's output to $OUT/NAME.txt and the terminal; remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name FAILED (exit $rc)"; status=1; }
  return "$rc"
}

for stage in $STAGES; do
  case $stage in
    env)
      run env "$PY" - <<'EOF' || exit 1
import importlib.util, sys
print("python", sys.version.split()[0])
if importlib.util.find_spec("tensorrt") is None:
    sys.exit("no tensorrt Python package: install TensorRT 10.x (JetPack: python3-libnvinfer) and make the venv "
             "with --system-site-packages")
import tensorrt, torch
print("tensorrt", tensorrt.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("torch has no CUDA device: install the CUDA build of torch (Jetson: NVIDIA's wheel)")
print("gpu", torch.cuda.get_device_name(), "sm", "%d.%d" % torch.cuda.get_device_capability())
EOF
      ;;
    api) run pytest_api "$PY" -m pytest -q -p no:cacheprovider test/test_tensorrt_api.py ;;
    device) run pytest_device "$PY" -m pytest -q -s -p no:cacheprovider -rs test/test_trt_batch_device.py ;;
    time) run timing "$PY" scripts/measure_batch_trt.py --json "$OUT/timing.json" ;;
    *) echo "unknown stage '$stage' (env api device time)"; exit 2 ;;
  esac
done
echo "== done: $( [ $status -eq 0 ] && echo all stages passed || echo SOME STAGE FAILED ), outputs in $OUT"
exit $status

#!/usr/bin/env bash
# The device check a Jetson AGX Thor owner runs (JetPack 7.x; also any x86 GPU tensorrt-edgellm 0.11.0 ships for):
#   1. install    scripts/setup.sh when there is no .venv yet (SETUP=1 forces it)
#   2. preflight  spec-edge plan --device per profile: the memory plan, then one line per piece a build needs
#                 (Edge-LLM's native payload for this board or why none, GPU, CUDA / TensorRT libraries, free memory;
#                 ModelOpt, datasets, calibration set for a quantized profile), each MISSING one saying what to
#                 install or set; stops here when anything is missing
#   3. build      spec-edge build config/smollm2_trt_eagle3.yaml (the embedded default + its committed EAGLE-3 head)
#                 and, when $LLAMA (default /models/Llama-3.1-8B-Instruct) and $LLAMA_HEAD hold the 8B checkpoint and
#                 yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, $LLAMA_PROFILE (default thor_llama31_8b_eagle3: fp16, no calibration)
#                 with model.target = $LLAMA and speculative.eagle3_head = $LLAMA_HEAD: where they differ from the
#                 profile's own paths, the profile is written with them to $OUT/profiles/$LLAMA_PROFILE.yaml (same
#                 profile name, so the engines land where the committed profile looks) and every stage uses that file
#   4. answer     scripts/thor_check.py per built profile: three prompts through the node's Engine with eagle3 and with
#                 none, greedy: tok/s, acceptance, speculative == plain (near-tie rule)
# Usage (from the checkout): scripts/thor_check.sh          STAGES="build answer" scripts/thor_check.sh
# Output: $OUT (default /tmp/spec_edge_thor_check): preflight_<profile>.txt, build_<profile>.txt,
# answer_<profile>.txt/.json. What it should print is in docs/tensorrt.md ("The device check"). Exit status 0 only
# when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spec_edge_thor_check}
STAGES=${STAGES:-"install preflight build answer"}
LLAMA=${LLAMA:-/models/Llama-3.1-8B-Instruct}
LLAMA_HEAD=${LLAMA_HEAD:-/models/EAGLE3-LLaMA3.1-Instruct-8B}
LLAMA_PROFILE=${LLAMA_PROFILE:-thor_llama31_8b_eagle3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-82} LLAMA LLAMA_HEAD
status=0

llama_profile() {  # the 8B profile with $LLAMA / $LLAMA_HEAD as its paths (the committed file when they are its own)
  .venv/bin/python - "config/$LLAMA_PROFILE.yaml" "$OUT/profiles" <<'PY'
import os, sys
from pathlib import Path
from spec_edge.config import dump, load

source, folder = Path(sys.argv[1]), Path(sys.argv[2])
cfg = load(source)
want = {"model.target": os.environ["LLAMA"]}
if cfg.speculative.drafter == "eagle3":
    want["speculative.eagle3_head"] = os.environ["LLAMA_HEAD"]
have = {"model.target": cfg.model.target, "speculative.eagle3_head": cfg.speculative.eagle3_head}
if all(Path(value) == Path(have[key]) for key, value in want.items()):
    print(source)
else:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / source.name).write_text(f"# {source} with LLAMA / LLAMA_HEAD (scripts/thor_check.sh)\n" + dump(cfg.replace(**want)))
    print(folder / source.name)
PY
}

profiles() {  # the profiles the stages run, once .venv exists
  [ -n "${PROFILES+x}" ] && return 0
  PROFILES=(config/smollm2_trt_eagle3.yaml)
  if [ -f "$LLAMA/config.json" ] && [ -f "$LLAMA_HEAD/config.json" ]; then
    local p
    p=$(llama_profile) || { echo "== cannot write $LLAMA_PROFILE with LLAMA=$LLAMA LLAMA_HEAD=$LLAMA_HEAD"; exit 1; }
    PROFILES+=("$p")
    echo "== $LLAMA_PROFILE: target $LLAMA, head $LLAMA_HEAD ($p)"
  else
    echo "== $LLAMA_PROFILE skipped: no $LLAMA/config.json or $LLAMA_HEAD/config.json (set LLAMA / LLAMA_HEAD)"
  fi
}

run() {  # run NAME CMD...: output to $OUT/NAME.txt and the terminal; remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name FAILED (exit $rc)"; status=1; }
  return "$rc"
}

for stage in $STAGES; do
  case $stage in
    install)
      if [ "${SETUP:-0}" = 1 ] || [ ! -x .venv/bin/python ]; then run install scripts/setup.sh || exit 1; fi ;;
    preflight)
      profiles
      for p in "${PROFILES[@]}"; do
        run "preflight_$(basename "$p" .yaml)" .venv/bin/python -m spec_edge.cli plan "$p" --device || exit 1
      done ;;
    build)
      profiles
      for p in "${PROFILES[@]}"; do run "build_$(basename "$p" .yaml)" .venv/bin/python -m spec_edge.cli build "$p"; done ;;
    answer)
      profiles
      for p in "${PROFILES[@]}"; do
        n=$(basename "$p" .yaml)
        run "answer_$n" .venv/bin/python scripts/thor_check.py "$p" --json-out "$OUT/answer_$n.json"
      done ;;
    *) echo "unknown stage $stage (install preflight build answer)"; exit 2 ;;
  esac
done
echo "== thor_check: $([ $status -eq 0 ] && echo ALL PASSED || echo FAILED) (outputs in $OUT)"
exit $status

"""TensorRT on the robot (Jetson AGX Thor): engine specs, builds, manifests and the memory plan
(spec-edge build / plan, the build_engines executable).

  engine_file.py an engine file streamed into TensorRT (its load peak) and its cheap start-up stamp
  presets.py     published model and head configs (plans without weights)
  head_memory.py the EAGLE-3 head's bytes in the plan (engine weights, its KV, I/O, the shared table)
  meminfo.py     is this a Jetson, what /proc/meminfo says
  memory.py      the memory plan: byte arithmetic, refusal with the numbers, largest context
  projection.py  the decode-speed projection: time per call, expected tokens, the k table
  profiles.py    a profile without weights: its yaml, its models' architectures, its plan inputs
  specs.py       the engines a profile needs (EngineSpec, build keys), ONNX inspection, file hashes
  manifest.py    manifest.json, the engine identity, check_engines() (what the runtime calls)
  builder.py     the build: TensorRT (lazily imported), timing cache, progress monitor, build()
  commands.py    `spec-edge plan` / `spec-edge build` command lines, docs/thor_profiles.md

Inside device/ each module imports only modules listed above it (never back up the list).

May import: config, graphs, heads.
"""

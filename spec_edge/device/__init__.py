"""TensorRT Edge-LLM on the robot (Jetson AGX Thor): the memory plan, the build pipeline and its manifest
(spec-edge plan / build, the build_engines executable).

  presets.py        published model and head configs (plans without weights)
  meminfo.py        is this a Jetson, what /proc/meminfo says
  memory.py         the memory plan of what Edge-LLM builds: byte arithmetic, refusal with the numbers
  projection.py     the decode-speed projection: time per call, expected tokens, the k table
  profiles.py       a profile without weights: its yaml, its models' architectures, its plan inputs
  checkpoint.py     the folders Edge-LLM's exporter reads (the GGUF converted, the head in Edge-LLM's layout)
  preflight.py      what a build needs on this machine (Edge-LLM's own detection), one finding per piece
  edgellm_build.py  the stages: plan -> checkpoint -> quantize -> export -> engines (LLMBuilder, lazily)
  commands.py       `spec-edge plan` / `spec-edge build` command lines, docs/thor_profiles.md

Inside device/ each module imports only modules listed above it (never back up the list).

Where the artifacts live and Edge-LLM's names: spec_edge/edgellm_layout.py (the leaf the runtime reads too).

May import: config, edgellm_layout, graphs, heads.
"""

"""The command lines `spec-edge plan` and `spec-edge build` (also the ROS executable build_engines),
and the generated plan documentation: docs/thor_profiles.md and the `#@plan` comment block of each
config/thor_*.yaml (write_profile_docs).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spec_edge.config import Config, ConfigError, load, speculative_k
from spec_edge.device import edgellm_build, memory, preflight, projection
from spec_edge.device.edgellm_build import BuildError
from spec_edge.edgellm_layout import ManifestError, batch_engine_dir, engine_dirs
from spec_edge.device.profiles import plan_for_config, resolve_profile

# ---------------------------------------------------------------------------------------------
# Command lines (the lead wires these into `spec-edge build|plan` and the ROS executable)


def _load_profile(arg: str, overrides: dict[str, Any]) -> Config:
    cfg = load(resolve_profile(arg))
    return cfg.replace(**overrides) if overrides else cfg


def _without_ros_args(argv: Sequence[str] | None) -> list[str]:
    """argv without the `--ros-args ...` tail `ros2 run` / launch may append."""
    args = list(sys.argv[1:] if argv is None else argv)
    return args[:args.index("--ros-args")] if "--ros-args" in args else args


def plan_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spec-edge plan", description="Print the memory plan of a profile.")
    parser.add_argument("profile", help="profile yaml, or a name in config/ (e.g. thor_llama31_8b_eagle3_nvfp4)")
    parser.add_argument("--max-context", type=int, help="plan this graphs.max_context instead")
    parser.add_argument("--k", type=int, help="plan this speculative.k (must be in graphs.k_values)")
    parser.add_argument("--config-only", action="store_true", help="ignore the memory of this machine")
    parser.add_argument("--device", action="store_true",
                        help="also list what a full `spec-edge build` needs on this machine (the preflight: Edge-LLM's "
                             "payload, GPU, CUDA / TensorRT, free memory; ModelOpt, datasets, calibration when "
                             "quantized); exit 1 when something is missing")
    parser.add_argument("--alpha", type=float,
                        help="draft acceptance rate for the k table (default: the profile's assumed rate, "
                             "0.7 when none; measure it with `spec-edge bench`)")
    args = parser.parse_args(_without_ros_args(argv))
    overrides: dict[str, Any] = {}
    if args.max_context:
        overrides["graphs.max_context"] = args.max_context
    if args.k:
        overrides["speculative.k"] = args.k
    try:
        cfg = _load_profile(args.profile, overrides)
        device = None if args.config_only else memory.read_device_memory()
        the_plan = plan_for_config(cfg, device)
    except ConfigError as err:
        print(f"spec-edge plan: {err}", file=sys.stderr)
        return 2
    print(the_plan.table())
    alpha = args.alpha if args.alpha is not None else ASSUMED_ALPHA.get(cfg.runtime.profile, 0.7)
    print(projection.k_table(the_plan.inputs, alpha))
    missing = False
    if args.device:
        findings = preflight.check(cfg, device=True, plan=the_plan)
        print(preflight.report(findings))
        missing = not all(f.ok for f in findings)
        if missing:
            print(f"  ({preflight.EXPORT_ONLY})")
    if not the_plan.fits:
        try:
            memory.check(the_plan)
        except memory.PlanError as err:
            print(str(err).split("\n", 1)[0], file=sys.stderr)
        return 1
    return 1 if missing else 0


def build_main(argv: Sequence[str] | None = None, prog: str = "spec-edge build") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Build a profile's TensorRT Edge-LLM engines: plan -> checkpoint -> quantize -> "
                               "export -> engines (spec_edge/device/edgellm_build.py).")
    parser.add_argument("profile", help="profile yaml, or a name in config/")
    parser.add_argument("--force", action="store_true", help="redo every stage")
    parser.add_argument("--engine-dir", help="override runtime.engine_dir (relative to the current directory)")
    parser.add_argument("--check", action="store_true", help="only check the built engines against the profile")
    parser.add_argument("--export-only", action="store_true",
                        help="every stage that needs no GPU (plan, checkpoint, quantize, export) with their manifest")
    parser.add_argument("--weights", choices=memory.QUANTIZATIONS, help="override graphs.weights (the target's form)")
    args = parser.parse_args(_without_ros_args(argv))
    overrides = {"runtime.engine_dir": str(Path(args.engine_dir).expanduser().absolute())} if args.engine_dir else {}
    if args.weights:
        overrides["graphs.weights"] = args.weights
    try:
        cfg = _load_profile(args.profile, overrides)
        if args.check:
            target, draft = engine_dirs(cfg)
            batch = batch_engine_dir(cfg)
            print(f"engines for '{cfg.runtime.profile}' match the profile: {target}"
                  + (f", draft in {draft}" if draft else "") + (f", batch engine {batch}" if batch else ""))
            return 0
        edgellm_build.build(cfg, args.profile, export_only=args.export_only, force=args.force,
                            progress=lambda text: print(text, file=sys.stderr, flush=True))
    except (ConfigError, BuildError, ManifestError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# docs/thor_profiles.md and the plan comments of config/thor_*.yaml

# acceptance rates assumed for the k tables until the device check (scripts/thor_check.sh) measures them
ASSUMED_ALPHA = {"thor_llama31_8b_eagle3": 0.80, "thor_llama31_8b_eagle3_int4": 0.80,
                 "thor_llama31_8b_eagle3_fp8": 0.80, "thor_llama31_8b_eagle3_nvfp4": 0.80}


def profile_report(cfg: Config, alpha: float) -> str:
    """The plan and the k table."""
    p = plan_for_config(cfg, None)
    return p.table() + "\n" + projection.k_table(p.inputs, alpha)


def _precision(cfg: Config) -> str:
    return "fp16" if cfg.graphs.weights == "fp32" else f"{cfg.graphs.weights} + fp16"


def write_profile_docs(config_dir: Path, doc_path: Path) -> None:
    """Regenerate the `#@plan` comment block of each config/thor_*.yaml and docs/thor_profiles.md."""
    sections = ["# Thor profiles\n",
                "Generated by `spec_edge.device.commands.write_profile_docs` from config/thor_*.yaml "
                "(memory.py's and projection.py's arithmetic for what TensorRT Edge-LLM builds; acceptance rates "
                "are assumptions until the device check measures them). `spec-edge plan <profile>` prints the same "
                "on the robot, with its real free memory.\n",
                "| profile | target + drafter | weights | k | batch | max_context | total GiB | largest context | "
                "speed-up at k (assumed alpha) |", "|---|---|---|---|---|---|---|---|---|"]
    details = []
    for path in sorted(Path(config_dir).glob("thor_*.yaml")):
        cfg = load(path)
        alpha = ASSUMED_ALPHA.get(path.stem, 0.7)
        report = profile_report(cfg, alpha)
        p = plan_for_config(cfg, None)
        c = projection.draft_cost(p.inputs)
        draft = (f"eagle3 {Path(cfg.speculative.eagle3_head).name}" if cfg.speculative.drafter == "eagle3"
                 else cfg.speculative.drafter)
        speed = f"{projection.speedup(alpha, speculative_k(cfg), c):.2f}x ({alpha})" if c is not None else "-"
        sections.append(f"| {path.stem} | {Path(cfg.model.target).name} + {draft} | {_precision(cfg)} | "
                        f"{speculative_k(cfg)} | {cfg.graphs.batch_slots} | {cfg.graphs.max_context} | "
                        f"{p.total / memory.GIB:.1f} | {p.largest_max_context} | {speed} |")
        details.append(f"\n## {path.stem}\n\n```\n{report}\n```\n")
        text = path.read_text()
        head, sep, body = text.partition("/**:")
        kept = [line for line in head.splitlines() if not line.startswith("#|")]
        block = [line.replace("#@plan", "") for line in kept]
        block = [line for line in block if line] + ["#@plan"] + ["#| " + r for r in report.splitlines()]
        path.write_text("\n".join(block) + "\n" + sep + body)
    doc_path.write_text("\n".join(sections) + "\n" + "".join(details))


def build_engines_main() -> int:
    """The ROS executable `ros2 run spec_edge build_engines PROFILE`: build_main under its own name."""
    return build_main(prog="build_engines")

"""spec-edge: export | generate | bench | build | plan | serve | http | ask | engines.

A stable contract: scripts outside the project call these. Progress goes to stderr; with --json,
stdout holds exactly one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spec_edge import config as cfgmod
from spec_edge.config import Config, ConfigError


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and graphs (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--config", help="profile YAML (ROS 2 params file); default: the default profile (the "
                       "defaults in spec_edge/config.py, = config/default.yaml: q4 weights, 4 batch slots, n-gram k=4)")
    group.add_argument("--target", help="target model: 'embedded', a .gguf file or a Hugging Face folder")
    group.add_argument("--draft-model", help="draft model for --drafter draft (same forms as --target)")
    group.add_argument("--max-context", type=int, help="cache length the graphs are exported for")
    group.add_argument("--k-values", type=int, nargs="+", help="export a verify graph for each k")
    group.add_argument("--engine-dir", help="where exported graphs / engines go, relative to the current directory "
                       "(default: runtime.engine_dir under the user cache: ~/.cache/spec_edge/engines)")
    group.add_argument("--profile", help="artifact folder name under the engine dir")
    group.add_argument("--backend", choices=cfgmod.BACKENDS)
    group.add_argument("--threads", type=int, help="ONNX Runtime threads (0 = all cores)")
    group.add_argument("--eagle3-head", help="EAGLE-3 head folder for --drafter eagle3 or hybrid (speculative.eagle3_head)")
    group.add_argument("--medusa-head", help="Medusa heads folder for --drafter medusa (speculative.medusa_head)")
    group.add_argument("--peagle-head", help="parallel-drafting head folder for --drafter peagle "
                       "(speculative.peagle_head)")


def _from_cwd(path: str | None) -> str | None:
    """A path typed on the command line means what the shell means: relative to the current directory."""
    return None if path is None else str(Path(path).expanduser().absolute())


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = cfgmod.load(args.config) if args.config else Config()
    overrides = {"model.target": args.target, "model.draft": args.draft_model,
                 "graphs.max_context": args.max_context, "runtime.engine_dir": _from_cwd(args.engine_dir),
                 "runtime.profile": args.profile, "runtime.backend": args.backend, "runtime.threads": args.threads,
                 "graphs.k_values": args.k_values, "speculative.eagle3_head": args.eagle3_head,
                 "speculative.medusa_head": args.medusa_head, "speculative.peagle_head": args.peagle_head}
    weights = getattr(args, "weights", None)
    if isinstance(weights, str):  # export / generate: one form (bench takes a list and runs each)
        overrides["graphs.weights"] = weights
    return cfg.replace(**{key: value for key, value in overrides.items() if value is not None})


def answered_by(args, cfg: Config) -> dict[str, str]:
    """The profile (the --config file, or "default") and the weights form that answered (--json, [stats])."""
    return {"profile": args.config or "default", "weights": cfg.graphs.weights}


def cmd_export(args) -> int:
    """What the profile serves from (artifacts.ensure: what every serving command makes first), each exported
    graph's static shapes checked; on tensorrt the target's (and draft model's) torch export alone."""
    import onnx

    from spec_edge import artifacts
    from spec_edge.graphs import export, plan

    cfg = config_from_args(args)
    runs = artifacts.ensure(cfg, progress)
    for role in ["target"] + (["draft"] if cfg.model.draft else []):
        out = export.export_model(cfg, role, plan.artifact_dir(cfg, role), progress)
        for onnx_file in sorted(out.glob("*.onnx")):
            checked, dynamic = export.dynamic_tensors(onnx.load(str(onnx_file), load_external_data=False))
            status = "all static" if not dynamic else f"DYNAMIC: {dynamic[:3]}"
            progress(f"[export] {onnx_file.name}: {checked} tensors, {status}")
    for role, folder in runs.items():
        progress(f"[export] {role}: ONNX Runtime runs {folder}")
    return 0


def request_from_args(args):
    from spec_edge.runtime.request_args import request_fields
    from spec_edge.runtime.requests import GenerateRequest

    return GenerateRequest(prompt=args.prompt, system_prompt=args.system or "", max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                           stop=tuple(args.stop or ()), drafter=args.drafter, k=args.k, chat=not args.raw,
                           forced_drafts=False if args.no_forced_drafts else None, **request_fields(args))


def cmd_generate(args) -> int:
    from spec_edge import artifacts

    if args.logprobs and not args.json:
        raise ConfigError("--logprobs is reported in --json's `logprobs` key: add --json")
    cfg = config_from_args(args)
    from spec_edge.runtime.requests import RequestError
    from spec_edge.runtime.scheduler import serve_alone

    request = request_from_args(args)  # its --k / --drafter are the request's, as every door's
    engine = artifacts.engine(cfg, progress)
    on_text = None if args.json else (lambda delta, n_tokens: print(delta, end="", flush=True))
    outcome = serve_alone(engine, request, on_text=on_text).outcome  # what ROS and HTTP answer
    if outcome.refusal == "invalid":
        raise RequestError(outcome.message)  # exit 2, in the words of every door
    if args.json:
        # strict JSON: no NaN / Infinity
        print(json.dumps({**outcome.as_dict(), **answered_by(args, cfg)}, allow_nan=False))
        return 0 if outcome.success else 1
    s = outcome.stats
    print()
    for call in outcome.tool_calls:
        print(f"[tool call {call.id}] {call.name}({call.arguments})")
    by = answered_by(args, cfg)
    if s:
        progress(f"[stats] profile={by['profile']} weights={by['weights']} finish={outcome.finish_reason} "
                 f"tokens={s['new_tokens']} drafter={s['drafter']} k={s['k']} "
                 f"drafted={s['drafted']} accepted={s['accepted']} acceptance={s['acceptance_rate']:.2f} "
                 f"mean_accepted_length={s['mean_accepted_length']:.2f} tok/s={s['tokens_per_s']:.1f} "
                 f"ttft={s['time_to_first_token_s'] * 1000:.0f} ms" + (f" forced={s['forced']} cut={s['cut']}"
                                                                          if s['forced'] or s['cut'] else ""))
    if outcome.message:
        progress(f"[note] {outcome.message}" if outcome.success else f"spec-edge: error: {outcome.message}")
    return 0 if outcome.success else 1


def cmd_bench(args) -> int:
    from spec_edge.tools import bench

    if args.guided:
        from spec_edge.tools import guided_bench

        return guided_bench.main(config_from_args(args), args, progress)
    return bench.main(config_from_args(args), args, progress)


def cmd_http(args) -> int:
    from spec_edge.http import door

    cfg = config_from_args(args)
    cfg = cfg.replace(**{key: value for key, value in (("http.host", args.host), ("http.port", args.port))
                         if value is not None})
    from spec_edge.ros2.shutdown import exit_process, start_watchdog

    # once serving, a signal ends the process within 2 s, as the node's (docs/http.md)
    exit_process(door.run(cfg, progress, on_signal=start_watchdog))


def forward(module: str, function: str):
    def run(args) -> int:
        import importlib

        return getattr(importlib.import_module(f"spec_edge.{module}"), function)(args.rest)
    return run


def build_parser() -> argparse.ArgumentParser:
    from spec_edge.graphs.plan import ORT_WEIGHTS
    from spec_edge.runtime.request_args import add_request_arguments

    parser = argparse.ArgumentParser(prog="spec-edge", description="speculative decoding for robots")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export the static ONNX graphs of the configured models")
    add_config_args(p)
    p.add_argument("--weights", choices=ORT_WEIGHTS, help="target weights form ONNX Runtime runs (graphs.weights)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("generate", help="answer one prompt with speculative decoding")
    add_config_args(p)
    p.add_argument("--weights", choices=cfgmod.WEIGHTS, help="target weights form (graphs.weights)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", help="system prompt (default: the chat template's)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--drafter", choices=cfgmod.DRAFTERS, help="this request's drafter (the request's `drafter`, as "
                   "through ROS and HTTP; default: the profile's speculative.drafter)")
    p.add_argument("--k", type=int, help="this request's drafts per verify call (the request's `k`: one of the "
                   "exported graphs.k_values; `spec-edge export --k-values` builds others)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    add_request_arguments(p)
    p.add_argument("--no-forced-drafts", action="store_true",
                   help="guided: do not propose the grammar's forced tokens as drafts (speculative.forced_drafts)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="this engine: target-only vs each drafter x k, tok/s ratios side by side in one "
                       "run (against llama.cpp / transformers: python bench/peers.py)")
    add_config_args(p)
    p.add_argument("--drafters", nargs="+", default=["ngram", "layerskip"], choices=cfgmod.DRAFTERS[1:])
    p.add_argument("--ks", type=lambda v: v if v == cfgmod.AUTO_K else int(v), nargs="+",
                   help="k values to measure, `auto` among them for speculative.k auto (default: graphs.k_values, and "
                        "auto when the profile's speculative.k is auto)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, help="runs per prompt and system (default 1; --full: 3); tok/s is their median")
    p.add_argument("--kinds", nargs="+", help="prompt kinds to run (default: all)")
    p.add_argument("--json-out", help="also write the results here")
    p.add_argument("--full", action="store_true",
                   help="every prompt, temperatures 0/0.7/1.0, 3 repeats, weights fp32 and q4 (default: quick mode)")
    p.add_argument("--prompts", help="prompt file (default: bench/prompts.jsonl)")
    p.add_argument("--temperatures", type=float, nargs="+", help="sampling temperatures (default: 0; --full: 0 0.7 1)")
    p.add_argument("--weights", nargs="+", choices=ORT_WEIGHTS, help="graphs.weights variants to measure")
    p.add_argument("--guided", action="store_true",
                   help="instead: constrained decoding on bench/robot_schemas.jsonl (or --prompts), free vs guided vs "
                        "guided + forced drafts for drafter none and each --drafters (validity, tok/s, acceptance)")
    p.add_argument("--ort-attention", nargs="+", choices=cfgmod.ORT_ATTENTION,
                   help="graphs.ort_attention variants to measure (default: the profile's); rows of the "
                        "exported attention are labelled <weights>+graph")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("http", help="serve an OpenAI-compatible HTTP API (/v1/chat/completions ...) without ROS")
    add_config_args(p)
    p.add_argument("--host", help="address to bind (http.host, default 127.0.0.1; another needs http.api_key)")
    p.add_argument("--port", type=int, help="port (http.port, default 8000; 0: any free port)")
    p.set_defaults(func=cmd_http)

    p = sub.add_parser("engines", help="list the graph folders (form, size, graphs, last use, users); "
                       "--prune the unused")
    p.add_argument("--engine-dir", help="the engines folder to list (default: runtime.engine_dir's)")
    p.add_argument("--config", nargs="+", help="more profiles whose folders count as used (besides the defaults "
                   "and config/*.yaml)")
    p.add_argument("--prune", action="store_true", help="remove the folders no profile uses")
    p.set_defaults(func=lambda args: __import__("spec_edge.graphs.inventory", fromlist=["main"]).main(args, progress))

    for name, module, function, text in (
            ("build", "device.commands", "build_main", "build a profile's TensorRT Edge-LLM engines (--export-only: no GPU)"),
            ("plan", "device.commands", "plan_main", "print the memory plan of a profile"),
            ("serve", "ros2.node", "serve_main", "start the ROS 2 node without ros2 launch"),
            ("ask", "ros2.client", "ask_main", "call /generate as a ROS 2 client")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=forward(module, function))
    return parser


# what left this command, and the command that does it now
MOVED = {
    ("train-draft",): "training is its own package: spec-edge-train (same options; scripts/setup.sh installs it, "
                      "or pip install -e training)",
    ("bench", "--peers"): "the comparison with llama.cpp and transformers is a script: python bench/peers.py "
                          "(spec-edge bench's options, and --peers)",
    ("bench", "--hf-baseline"): "the comparison with transformers is a script: python bench/peers.py --peers transformers",
    ("bench", "--accuracy"): "the accuracy of each weights form is a script: python bench/accuracy.py",
}


def main(argv: list[str] | None = None) -> int:
    from spec_edge.runtime.backends.base import BackendError
    from spec_edge.runtime.requests import RequestError

    words = sys.argv[1:] if argv is None else list(argv)
    for (command, *flag), now in MOVED.items():
        if words[:1] == [command] and (not flag or any(w.split("=")[0] == flag[0] for w in words[1:])):
            print(f"spec-edge: error: `spec-edge {' '.join([command, *flag])}` moved: {now}", file=sys.stderr)
            return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(words)
    if extra:  # options before a forwarded command's first positional (`ask --prompt X`)
        if not hasattr(args, "rest"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.rest = extra + list(args.rest)
    try:
        return args.func(args)
    except (ConfigError, RequestError, BackendError) as err:
        print(f"spec-edge: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spec-edge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

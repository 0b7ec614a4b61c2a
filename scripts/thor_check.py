"""The answers half of the Thor device check (scripts/thor_check.sh): three prompts through the Engine the ROS node
serves with (spec_edge.runtime.engine.Engine on runtime.backend tensorrt = TensorRT Edge-LLM), greedy, each with
the profile's drafter (eagle3, k = speculative.k) and with drafter none, and for each prompt: tok/s, acceptance,
and whether greedy speculative equals greedy plain.

Near-tie rule (as the CPU checks count it, docs/bench.md): equal token for token, or the two part at a token where
a float32 reference (transformers, the profile's own Hugging Face checkpoint) puts its top-2 logits within 0.05:
fp16 verify and step calls round differently and may flip a near tie; past that point the texts legitimately
differ. A part at a larger margin is a real difference and fails the check (exit 1).

Usage: python scripts/thor_check.py PROFILE [--max-new-tokens 128] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = ["Move the arm to the left and report the gripper state.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "The robot picks up the red box and places it on the shelf. Summarise what happened."]
NEAR_TIE = 0.05


_REFERENCES: dict[Path, object] = {}  # checkpoint -> its float32 transformers model, loaded once


def reference_margin(checkpoint: Path, ids: list[int]) -> float:
    """top-1 minus top-2 logit of the float32 reference after `ids`."""
    import torch
    from transformers import AutoModelForCausalLM

    if checkpoint not in _REFERENCES:
        _REFERENCES[checkpoint] = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    model = _REFERENCES[checkpoint]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check(engine, checkpoint: Path, drafter: str, k: int, max_new_tokens: int, near_tie: float = NEAR_TIE,
          margin=reference_margin, prompts=PROMPTS) -> tuple[list[dict], bool]:
    """The rows for `prompts` through `engine` (any serving.Decoder: engine.Engine or the Edge-LLM adapter), greedy,
    with `drafter` (k) and with none, and whether a divergence failed (a part at a reference margin >= near_tie).
    margin(checkpoint, ids): the reference's top-1 minus top-2 logit after ids; the ids are the prompt's as the
    decoder's front tokenizes it (Front.prompt_ids) plus the plain answer up to the part."""
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import run_one
    from spec_edge.runtime.serving import front_of

    rows, failed = [], False
    for prompt in prompts:
        runs = {}
        for name in ([drafter] if drafter != "none" else []) + ["none"]:
            request = GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                      drafter=name, k=k if name != "none" else None)
            run_one(engine, request)  # warm-up (CUDA graphs, first-call allocations)
            runs[name] = run_one(engine, request)
        plain = runs["none"]
        row = {"prompt": prompt, "plain_tok_s": round(plain.stats.tokens_per_s, 1)}
        if drafter != "none":
            spec = runs[drafter]
            row.update(spec_tok_s=round(spec.stats.tokens_per_s, 1),
                       speedup=round(spec.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9), 2),
                       acceptance=round(spec.stats.acceptance_rate, 3),
                       mean_accepted_length=round(spec.stats.mean_accepted_length, 2))
            a, b = spec.token_ids, plain.token_ids
            if a == b:
                row["greedy"] = "equal"
            else:
                at = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
                m = margin(checkpoint, front_of(engine).prompt_ids(GenerateRequest(prompt=prompt)) + b[:at])
                row["greedy"] = (f"near tie at token {at} (float32 margin {m:.3f})" if m < near_tie
                                 else f"DIFFERENT at token {at} (float32 margin {m:.3f})")
                failed |= m >= near_tie
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json-out")
    args = parser.parse_args()

    from spec_edge.config import load
    from spec_edge.edgellm_layout import profile_dir, read_manifest
    from spec_edge.device.profiles import resolve_profile
    from spec_edge.runtime.decoders import open_decoder

    cfg = load(resolve_profile(args.profile))
    drafter, k = cfg.speculative.drafter, cfg.speculative.k
    checkpoint = Path(read_manifest(profile_dir(cfg))["stages"]["checkpoint"]["target"])
    engine = open_decoder(cfg, lambda text: print(text, file=sys.stderr, flush=True))
    rows, failed = check(engine, checkpoint, drafter, k, args.max_new_tokens)
    summary = {"profile": cfg.runtime.profile, "drafter": drafter, "k": k, "rows": rows, "ok": not failed}
    print(f"[thor_check] {cfg.runtime.profile}: " + ("OK" if not failed else "FAILED: speculative != plain beyond "
                                                      "a near tie"), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

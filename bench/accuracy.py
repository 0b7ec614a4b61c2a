"""What each graphs.weights form (q4, q4_fp32act) costs in accuracy
against fp32, and that speculation stays exact on it. ONNX Runtime runs the very files each form produces.

Per form, on the held-out prompts (bench/prompts.jsonl) and a held-out text (bench/heldout.txt):
  top-1      share of positions where the form's argmax equals fp32's, both fed fp32's own greedy
             continuation (teacher forcing: every position sees the same prefix)
  KL         mean KL(p_fp32 || p_form) over those positions (nats)
  ppl        perplexity of the held-out text (fp32's is the reference row)
  greedy     the form's own greedy continuation vs fp32's: mean share of the prefix that agrees,
             and how many continuations are identical
  exact      speculative greedy == the form's own target-only greedy, per drafter (runs / runs)
  tok/s      target-only greedy decode speed on this machine

    PYTHONPATH=$PWD .venv/bin/python bench/accuracy.py [--weights q4 q4_fp32act] [--drafters ngram] \
        [--config PROFILE] [--prompts FILE] [--kinds ...] [--max-new-tokens 48] [--json-out FILE]
(spec-edge bench's options; the drafters run on each form's own engine: eagle3 needs a profile with its head,
e.g. config/smollm2_eagle3.yaml)
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from spec_edge.config import speculative_k

HELDOUT_TEXT = Path(__file__).resolve().parent / "heldout.txt"


@dataclass
class Row:
    weights: str
    top1: float = 1.0
    kl: float = 0.0
    ppl: float = 0.0
    greedy_prefix: float = 1.0
    greedy_same: int = 0
    n_prompts: int = 0
    exact: dict[str, tuple[int, int]] = field(default_factory=dict)
    tokens_per_s: float = 0.0


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def forced_logits(runner, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """(len(continuation), V): the logits that predict each continuation token, prompt prefilled, then
    one step per token (the step graph every decode uses)."""
    runner.held = ()  # the calls below rewrite the slot's rows: the next request runs cold
    rows = [runner.prefill(prompt, 0).copy()]
    for i, token in enumerate(continuation[:-1]):
        rows.append(runner.forward([token], len(prompt) + i)[0].copy())
    return np.stack(rows)


def _greedy(engine, prompt: str, max_new: int, drafter: str = "none", k: int = 0) -> tuple[list[int], float]:
    """(the greedy token ids of prompt through the scheduler, tok/s): target-only, or drafter at k."""
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import run_one

    started = time.perf_counter()
    result = run_one(engine, GenerateRequest(prompt=prompt, max_new_tokens=max_new, temperature=0.0,
                                             speculate=drafter != "none", drafter=None if drafter == "none" else drafter,
                                             k=k or None))
    out = result.token_ids
    return out, len(out) / max(time.perf_counter() - started, 1e-9)


def evaluate(cfg, forms: list[str], prompts: list[str], text: str, drafters: dict[str, object],
             max_new: int = 32, progress=print) -> list[Row]:
    """Rows for fp32 and each form. drafters: name -> Config overrides that make the drafter
    (e.g. {"eagle3": {"speculative.drafter": "eagle3", ...}}); its k is speculative.k."""
    from spec_edge import artifacts

    fp32 = artifacts.engine(cfg.replace(**{"graphs.weights": "fp32"}), progress)
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.serving import front_of

    prompt_ids = [front_of(fp32).prompt_ids(GenerateRequest(prompt=p)) for p in prompts]  # as _greedy's requests
    text_ids = fp32.tokenizer.encode(text)
    reference = [_greedy(fp32, p, max_new)[0] for p in prompts]
    ref_logp = [_log_softmax(forced_logits(fp32.target, ids, cont)) for ids, cont in zip(prompt_ids, reference) if cont]
    ref_text = _log_softmax(forced_logits(fp32.target, text_ids[:1], text_ids[1:]))
    rows = []
    for form in ["fp32"] + [f for f in forms if f != "fp32"]:
        engine = fp32 if form == "fp32" else artifacts.engine(cfg.replace(**{"graphs.weights": form}), progress)
        row = Row(form, n_prompts=len(prompts))
        agree, kls = [], []
        for ids, cont, ref in zip(prompt_ids, reference, ref_logp):
            logp = _log_softmax(forced_logits(engine.target, ids, cont))
            agree.append(np.mean(logp.argmax(-1) == ref.argmax(-1)))
            kls.append(np.mean(np.sum(np.exp(ref) * (ref - logp), axis=-1)))
        text_logp = _log_softmax(forced_logits(engine.target, text_ids[:1], text_ids[1:]))
        row.ppl = float(np.exp(-np.mean(text_logp[np.arange(len(text_ids) - 1), text_ids[1:]])))
        row.top1, row.kl = float(np.mean(agree)), float(np.mean(kls))
        prefixes, speeds = [], []
        for prompt, ref_cont in zip(prompts, reference):
            own, speed = _greedy(engine, prompt, max_new)
            speeds.append(speed)
            same = next((i for i, (a, b) in enumerate(zip(own, ref_cont)) if a != b), min(len(own), len(ref_cont)))
            prefixes.append(same / max(len(ref_cont), 1))
            row.greedy_same += own == ref_cont
            for name, overrides in drafters.items():
                spec_engine = engine if not overrides else _with(engine, cfg, form, overrides, progress)
                got, _ = _greedy(spec_engine, prompt, max_new, name, speculative_k(spec_engine.cfg))
                base = own if spec_engine is engine else _greedy(spec_engine, prompt, max_new)[0]
                hit, total = row.exact.get(name, (0, 0))
                row.exact[name] = (hit + (got == base), total + 1)
        row.greedy_prefix, row.tokens_per_s = float(np.mean(prefixes)), float(np.median(speeds))
        progress(f"[accuracy] {form}: top-1 {row.top1:.3f}, KL {row.kl:.4f}, ppl {row.ppl:.2f}, exact {row.exact}")
        rows.append(row)
    del ref_text
    return rows


_ENGINES: dict[tuple, object] = {}


def _with(engine, cfg, form, overrides, progress):
    from spec_edge import artifacts

    key = (form, tuple(sorted(overrides.items())))
    if key not in _ENGINES:
        _ENGINES[key] = artifacts.engine(cfg.replace(**{"graphs.weights": form, **overrides}), progress)
    return _ENGINES[key]


def table(rows: list[Row]) -> str:
    names = sorted({n for r in rows for n in r.exact})
    head = (f"{'weights':<10s} {'top-1':>6s} {'KL':>8s} {'ppl':>7s} {'greedy prefix':>13s} {'same':>6s} "
            + " ".join(f"{'exact ' + n:>12s}" for n in names) + f" {'tok/s':>7s}")
    lines = [head]
    for r in rows:
        exact = " ".join(f"{f'{r.exact[n][0]}/{r.exact[n][1]}':>12s}" if n in r.exact else f"{'-':>12s}" for n in names)
        lines.append(f"{r.weights:<10s} {r.top1:6.3f} {r.kl:8.4f} {r.ppl:7.2f} {r.greedy_prefix:13.3f} "
                     f"{f'{r.greedy_same}/{r.n_prompts}':>6s} {exact} {r.tokens_per_s:7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from spec_edge import cli
    from spec_edge.config import ConfigError
    from spec_edge.tools.prompts import load_prompts

    args = cli.build_parser().parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        cfg = cli.config_from_args(args)
        forms = args.weights or ["q4", "q4_fp32act"]
        prompts = [p["prompt"] for p in load_prompts(Path(args.prompts) if args.prompts else None, args.kinds)]
        drafters = {name: {} for name in args.drafters if name != "layerskip" or len(args.drafters) == 1}
        rows = evaluate(cfg, forms, prompts, HELDOUT_TEXT.read_text(encoding="utf-8"), drafters,
                        max_new=min(args.max_new_tokens, 48), progress=cli.progress)
    except ConfigError as err:
        print(f"bench/accuracy.py: error: {err}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

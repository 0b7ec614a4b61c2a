"""spec_edge's own systems for `spec-edge bench`, and the record of one measured run.

A System is one thing the bench times: a name, its family (spec_edge, transformers, llama.cpp), the
weights it runs, its drafter and k, the plain system of its family (its ratio baseline) and a run()
that decodes one prompt into a Run. spec_systems builds spec_edge's: target-only and every drafter x k
per weights x ort_attention variant, each variant on its own Engine. The peers' systems (llama.cpp,
transformers) are bench/peers.py's, outside the package.
"""
from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# One measured generation


@dataclass
class Run:
    system: str
    prompt_id: str
    kind: str
    temperature: float
    repeat: int
    token_ids: list[int]
    tokens_per_s: float
    ttft_s: float
    total_s: float
    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0
    step_calls: int = 0
    acceptance: float | None = None
    mean_accepted_length: float | None = None
    finish: str = ""
    draft_s: float = 0.0      # time spent drafting (spec_edge's drafters)


@dataclass
class System:
    name: str
    family: str            # spec_edge | transformers | llama.cpp
    weights: str           # fp32 | q4 | q4_fp32act | Q4_1 (GGUF, llama.cpp)
    drafter: str           # none | ngram | layerskip | draft | prompt-lookup | assistant ...
    k: int
    plain: str             # the name of this family's plain system (its own ratio baseline)
    run: Callable[[dict, list[int], float, int, int], Run] = field(repr=False)
    temperatures: bool = True   # also runs at temperature > 0
    memory_mb: float = 0.0      # resident memory added when the system was loaded
    note: str = ""


def rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 1e6
    except ImportError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


# ---------------------------------------------------------------------------------------------
# spec_edge systems


def variant_label(weights: str, ort_attention: str) -> str:
    """A spec_edge variant's name in the report: 'q4', or 'q4+graph' for the exported attention."""
    return weights if ort_attention == "fused" else f"{weights}+{ort_attention}"


# variants whose speculative greedy output may differ from their own target-only output: 4-bit with int8
# activations on the exported attention, whose one-row calls sum otherwise (graphs/two_rows.py)
INEXACT_VARIANTS = ("q4+graph",)


def spec_systems(cfg, weights: list[str], drafters: list[str], ks: list[int], progress,
                 attentions: tuple[str, ...] = ("fused",), auto: bool = False) -> tuple[list[System], dict]:
    """Target-only and drafter x k systems per weights x ort_attention variant (auto: also each drafter
    with speculative.k auto, named 'k=auto', its k 0 in the report). At temperature > 0 only target-only
    and the profile's k (else the largest k asked; auto when asked) run: the temperature sweep is about
    acceptance."""
    from spec_edge.config import AUTO_K, speculative_k
    from spec_edge import artifacts
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.scheduler import run_one

    temp_k = speculative_k(cfg) if speculative_k(cfg) in ks else max(ks, default=0)

    systems: list[System] = []
    engines = {}
    for weights_name, attention in ((w, a) for w in weights for a in attentions):
        before = rss_mb()
        # serve.reuse_prefix off: every run is a cold request (the same prompt runs once per system, so
        # reuse would prefill one token for all but the first)
        engine = artifacts.engine(cfg.replace(**{"graphs.weights": weights_name, "graphs.ort_attention": attention,
                                                   "speculative.drafter": "none", "serve.reuse_prefix": False,
                                                   "speculative.k": AUTO_K if auto else speculative_k(cfg)}),
                                    progress)
        w = variant_label(weights_name, attention)  # the report's label of this variant
        engines[w] = engine
        plain_name = f"spec_edge[{w}] target-only"

        def make(engine=engine, drafter="none", k=0):
            def run(prompt, prompt_ids, temperature, seed, max_new):
                request = GenerateRequest(prompt=prompt["prompt"], drafter=drafter if drafter != "none" else None,
                                          speculate=drafter != "none", k=k or None, max_new_tokens=max_new,
                                          temperature=temperature, seed=seed)
                result = run_one(engine, request)
                s = result.stats
                return Run(system="", prompt_id=prompt["id"], kind=prompt["kind"], temperature=temperature,
                           repeat=0, token_ids=list(result.token_ids), tokens_per_s=s.tokens_per_s,
                           ttft_s=s.time_to_first_token_s, total_s=s.total_time_s, drafted=s.drafted,
                           accepted=s.accepted, verify_calls=s.verify_calls, step_calls=s.step_calls,
                           acceptance=s.acceptance_rate if drafter != "none" else None,
                           mean_accepted_length=s.mean_accepted_length if drafter != "none" else None,
                           finish=result.finish_reason, draft_s=s.draft_time_s)
            return run

        systems.append(System(plain_name, "spec_edge", w, "none", 0, plain_name, make()))
        for drafter in drafters:
            try:
                engine.drafter(drafter)  # load it now (layer-skip graphs, draft model)
            except Exception as err:  # a drafter this engine cannot run: say so, go on
                progress(f"[bench] spec_edge[{w}] drafter {drafter} skipped: {err}")
                continue
            for k in ks:
                systems.append(System(f"spec_edge[{w}] {drafter} k={k}", "spec_edge", w, drafter, k, plain_name,
                                      make(engine, drafter, k), temperatures=k == temp_k and not auto))
            if auto:  # the request's k unset: the engine's speculative.k auto
                systems.append(System(f"spec_edge[{w}] {drafter} k=auto", "spec_edge", w, drafter, 0, plain_name,
                                      make(engine, drafter), note="k auto"))
        mem = rss_mb() - before
        for s in systems:
            if s.weights == w and s.family == "spec_edge":
                s.memory_mb = mem
    return systems, engines

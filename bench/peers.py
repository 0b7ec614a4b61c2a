"""spec_edge beside its peers, same weights, same prompts, one run: `spec-edge bench`'s run loop
(spec_edge/tools/bench.py: interleaved rounds, ratios within a round, exactness) with these systems added.

    PYTHONPATH=$PWD .venv/bin/python bench/peers.py [any spec-edge bench option] \
        [--peers transformers llama.cpp | transformers-early-exit | none]


  transformers    generate() on the same fp32 weights (dequantized from the same GGUF): plain,
                  prompt_lookup_num_tokens=k, and an assistant (the configured draft model, else the
                  early-exit self-assistant `assistant_early_exit`)
  llama.cpp       llama-cpp-python on the same GGUF (Q4_1 weights: lower precision than fp32; marked so):
                  plain, and LlamaPromptLookupDecoding(k)

Each is skipped with a note when its package is missing; peer_run times a peer's run like spec_edge's.
The table's verdict puts the best spec_edge system against each peer (spec_edge/tools/report.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from spec_edge.tools.systems import Run, System, rss_mb


def peer_run(prompt: dict, temperature: float, new: list[int], started: float, t_first: float | None) -> Run:
    """A peer's Run timed like ours: decode tok/s counts the tokens after the first one."""
    total = time.perf_counter() - started
    ttft = (t_first or time.perf_counter()) - started
    n = len(new)
    tps = (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0
    return Run(system="", prompt_id=prompt["id"], kind=prompt["kind"], temperature=temperature, repeat=0,
               token_ids=new, tokens_per_s=tps, ttft_s=ttft, total_s=total)


# ---------------------------------------------------------------------------------------------
# transformers


def hf_systems(cfg, ks: list[int], eos_ids: tuple[int, ...], progress, full: bool = True) -> tuple[list[System], list[str]]:
    notes = []
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        return [], [f"transformers peer skipped: {err}"]
    from spec_edge.graphs.weights import resolve

    source = resolve(cfg.model.target)
    before = rss_mb()
    if source.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.eval()
    memory = rss_mb() - before
    assistant = None
    assistant_note = ""
    if cfg.model.draft:
        try:
            dsrc = resolve(cfg.model.draft)
            assistant = (AutoModelForCausalLM.from_pretrained(str(dsrc.parent), gguf_file=dsrc.name, dtype=torch.float32)
                         if dsrc.suffix == ".gguf" else AutoModelForCausalLM.from_pretrained(str(dsrc), dtype=torch.float32))
            assistant_note = f"assistant model {cfg.model.draft}"
        except Exception as err:  # noqa: BLE001 - a peer's failure is a note, not a crash
            notes.append(f"transformers assistant model not loaded: {err}")
    threads = torch.get_num_threads()

    class FirstToken:
        """generate() streamer: the first put() is the prompt; the second is the first new token."""

        def __init__(self):
            self.calls = 0
            self.t_first = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.t_first is None:
                self.t_first = time.perf_counter()

        def end(self):
            pass

    def make(extra: dict):
        def run(prompt, prompt_ids, temperature, seed, max_new):
            ids = torch.tensor([prompt_ids])
            kwargs = dict(max_new_tokens=max_new, eos_token_id=list(eos_ids), pad_token_id=eos_ids[0],
                          attention_mask=torch.ones_like(ids))
            if temperature > 0:
                torch.manual_seed(seed)
                kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            else:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            kwargs.update(extra)
            streamer = FirstToken()
            started = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, streamer=streamer, **kwargs)
            new = out[0, len(prompt_ids):].tolist()
            while new and new[-1] in eos_ids:
                new.pop()
            return peer_run(prompt, temperature, new, started, streamer.t_first)
        return run

    plain = "transformers plain"
    systems = [System(plain, "transformers", "fp32", "none", 0, plain, make({}), memory_mb=memory, temperatures=False,
                      note=f"torch {threads} threads")]
    k_pl = max(ks)
    systems.append(System(f"transformers prompt-lookup k={k_pl}", "transformers", "fp32", "prompt-lookup", k_pl, plain,
                          make({"prompt_lookup_num_tokens": k_pl}), temperatures=False, memory_mb=memory))
    if assistant is not None:
        systems.append(System("transformers assistant", "transformers", "fp32", "assistant", 0, plain,
                              make({"assistant_model": assistant}), temperatures=False, memory_mb=memory,
                              note=assistant_note))
    elif not full:
        notes.append("transformers early-exit assistant: only with --peers transformers-early-exit "
                     "(it decoded at ~1/10 of transformers plain here)")
    else:
        n_exit = cfg.graphs.layer_skip_layers
        systems.append(System(f"transformers early-exit assistant ({n_exit} layers)", "transformers", "fp32",
                              "early-exit", 0, plain, make({"assistant_early_exit": n_exit}), temperatures=False,
                              memory_mb=memory, note="no draft model configured: early-exit self-assistant"))
    return systems, notes


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llama_systems(cfg, ks: list[int], eos_ids: tuple[int, ...], threads: int, progress) -> tuple[list[System], list[str]]:
    try:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as err:
        return [], [f"llama.cpp peer skipped (pip install llama-cpp-python; it builds from source here, "
                    f"~15 min on 2 cores): {err}"]
    from spec_edge.graphs.weights import resolve

    source = resolve(cfg.model.target)
    if source.suffix != ".gguf":
        return [], ["llama.cpp peer skipped: the target is not a GGUF file"]
    n_threads = threads or os.cpu_count() or 1
    k_pl = max(ks)
    before = rss_mb()
    plain_model = Llama(model_path=str(source), n_ctx=cfg.graphs.max_context, n_threads=n_threads,
                        n_threads_batch=n_threads, verbose=False, logits_all=False)
    memory = rss_mb() - before
    lookup_model = Llama(model_path=str(source), n_ctx=cfg.graphs.max_context, n_threads=n_threads,
                         n_threads_batch=n_threads, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k_pl))

    def make(llm):
        def run(prompt, prompt_ids, temperature, seed, max_new):
            llm.reset()  # no prefix reuse from the previous run: every run prefills
            llm.set_seed(seed)
            started = time.perf_counter()
            t_first = None
            new: list[int] = []
            for token in llm.generate(list(prompt_ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                      typical_p=1.0, repeat_penalty=1.0, reset=True):
                if t_first is None:
                    t_first = time.perf_counter()
                if token in eos_ids:
                    break
                new.append(int(token))
                if len(new) >= max_new:
                    break
            return peer_run(prompt, temperature, new, started, t_first)
        return run

    plain = "llama.cpp plain"
    low = "Q4_1 weights (lower precision than fp32)"
    version = getattr(llama_cpp, "__version__", "?")
    return [System(plain, "llama.cpp", "Q4_1", "none", 0, plain, make(plain_model), memory_mb=memory,
                   note=f"llama-cpp-python {version}, {n_threads} threads; {low}"),
            System(f"llama.cpp prompt-lookup k={k_pl}", "llama.cpp", "Q4_1", "prompt-lookup", k_pl, plain,
                   make(lookup_model), memory_mb=memory, note=low)], []


# ---------------------------------------------------------------------------------------------
# The run: spec-edge bench's options and loop, these peers added

PEERS = ("transformers", "transformers-early-exit", "llama.cpp", "none")


def peer_systems(names: list[str]):
    """bench.main's `peers`: the systems of the peers named (none: spec_edge alone)."""
    def make(cfg, ks, eos_ids, progress):
        systems, notes = [], []
        if "transformers" in names or "transformers-early-exit" in names:
            progress("[bench] loading transformers peer ...")
            extra, more = hf_systems(cfg, ks, eos_ids, progress, "transformers-early-exit" in names)
            systems, notes = systems + extra, notes + more
        if "llama.cpp" in names:
            progress("[bench] loading llama.cpp peer ...")
            extra, more = llama_systems(cfg, ks, eos_ids, cfg.runtime.threads, progress)
            systems, notes = systems + extra, notes + more
        return systems, notes
    return make


def main(argv: list[str] | None = None) -> int:
    from spec_edge import cli
    from spec_edge.config import ConfigError
    from spec_edge.tools import bench

    own = argparse.ArgumentParser(prog="bench/peers.py", add_help=False,
                                  description="spec-edge bench's run loop with llama.cpp and transformers beside spec_edge")
    own.add_argument("--peers", nargs="+", choices=PEERS, default=["transformers", "llama.cpp"],
                     help="peer systems (default: transformers llama.cpp; skipped with a note when not installed)")
    mine, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        print(own.format_help() + "\nand every option of spec-edge bench:\n")
    args = cli.build_parser().parse_args(["bench", *rest])
    if args.guided:
        raise SystemExit("bench/peers.py: --guided runs spec_edge alone: spec-edge bench --guided")
    try:
        return bench.main(cli.config_from_args(args), args, cli.progress,
                          peer_systems([] if "none" in mine.peers else mine.peers))
    except ConfigError as err:
        print(f"bench/peers.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

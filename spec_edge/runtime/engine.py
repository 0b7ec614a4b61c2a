"""The engine: one target model (and its drafters) behind a request -> result call (ONNX Runtime; on
runtime.backend tensorrt, Engine.from_config returns backends/edgellm.py's EdgeLLMEngine instead: both are
a serving.RequestBackend).

This is what the CLI and the ROS node use. It checks a request, renders the chat prompt, runs the
speculative loop and turns tokens into text (streamed, UTF-8 safe, stop strings honoured). It is
not re-entrant (one KV cache): callers serialise requests; a lock enforces it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from spec_edge import speculation_policy
from spec_edge.config import Config, ConfigError
from spec_edge.graphs import export
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.base import Runner, common_prefix
from spec_edge.runtime.backends.onnxruntime import load_runner, ort_graphs
from spec_edge.runtime.drafting import Drafters
from spec_edge.runtime.grammar import Constraint, GrammarError, Grammars, grammar_spec
from spec_edge.runtime.requests import GenerateRequest, GenerateResult, RequestError, check_fits, check_stop
from spec_edge.runtime.serving import RequestBackend, chat_text, resolve_fields
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer


def text_emitter(decoder: StreamDecoder, on_text: Callable[[str, int], None] | None) -> speculative.Emit:
    """The loop's emit: feed a chunk of tokens to the stream decoder, hand on_text the safe-to-show
    text and the tokens so far; True once a stop string has shown up."""
    def emit(chunk: list[int]) -> bool:
        delta = decoder.push(chunk)
        if delta and on_text is not None:
            on_text(delta, len(decoder.ids))
        return decoder.stopped
    return emit


def incomplete_message(constraint: Constraint | None, finish: str, max_new: int) -> str:
    """The result's message when a guided output ended before it parses ("" otherwise)."""
    if constraint is None or finish == "eos" or constraint.complete:
        return ""
    return (f"finish_reason {finish}: the output is not complete under the {constraint.kind} (it does not parse yet"
            + (f"; raise max_new_tokens above {max_new})" if finish == "length" else ")"))


class Engine:
    concurrent = False  # one KV cache: callers serialise requests (a lock enforces it)

    def __init__(self, cfg: Config, target: Runner, tokenizer: Tokenizer, graph_dir: Path,
                 progress: Callable[[str], None] = print):
        self.cfg = cfg
        self.target = target
        self.tokenizer = tokenizer
        self.graph_dir = graph_dir
        self.progress = progress
        self.model_cfg = export.read_model_config(graph_dir)
        self.eos_ids = tuple(self.model_cfg.eos_ids)
        eos_text_id = tokenizer.token_id(tokenizer.eos_token) if tokenizer.eos_token else None
        if eos_text_id is not None and eos_text_id not in self.eos_ids:
            self.eos_ids += (eos_text_id,)
        self._drafters = Drafters(cfg, target, tokenizer, graph_dir, self.model_cfg, progress)
        self.grammars = Grammars(tokenizer, target.vocab_size, self.eos_ids)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[str], None] = print) -> RequestBackend:
        """Load the target (and a configured draft model) once; the graphs are exported first if
        missing or stale. runtime.backend tensorrt: the Edge-LLM engines `spec-edge build` made, served
        end to end by backends/edgellm.py (the same request -> result calls as this class)."""
        if cfg.runtime.backend == "tensorrt":
            from spec_edge.runtime.backends.edgellm import EdgeLLMEngine

            return EdgeLLMEngine.from_config(cfg, progress)
        graph_dir = export.artifact_dir(cfg, "target")
        progress(f"[engine] artifacts of profile '{cfg.runtime.profile}': {graph_dir.parent.parent} "
                 f"(runtime.engine_dir: {cfg.runtime.engine_dir})")
        graph_dir = ort_graphs(cfg, "target", export.export_model(cfg, "target", graph_dir, progress), progress)
        started = time.monotonic()
        target = load_runner(cfg, graph_dir)
        engine = cls(cfg, target, Tokenizer(graph_dir), graph_dir, progress)
        if cfg.speculative.drafter != "none":
            engine.drafter(cfg.speculative.drafter)  # load it now, not on the first request
        progress(f"[engine] {cfg.runtime.backend} ready in {time.monotonic() - started:.1f} s "
                 f"(max context {target.max_context}, verify widths {sorted(target.widths)})")
        return engine

    # -- drafters -------------------------------------------------------------------------
    def drafter(self, name: str):
        """The drafter `name` (one of config.DRAFTERS but "none") over this engine's target; what it
        runs on (a draft model, the layer-skip graphs, a head) is loaded on first use and kept."""
        return self._drafters.drafter(name)

    # -- requests -------------------------------------------------------------------------
    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        text = chat_text(self.tokenizer, request, self.cfg.serve.system_prompt)
        ids = self.tokenizer.encode(text)
        limit = self.target.max_context
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens but the context holds {limit} (prompt + answer): "
                               f"shorten the prompt or export with a larger graphs.max_context")
        if request.max_new_tokens is not None:  # as asked; the configured default adapts (context_full)
            check_fits(len(ids), int(request.max_new_tokens), limit)
        return ids

    def resolve(self, request: GenerateRequest) -> tuple[SamplingParams, int, int | None, str, int]:
        """(sampling, max_new_tokens, seed, drafter name, k) with config defaults filled in."""
        params, max_new, seed, drafter, k = resolve_fields(self.cfg, request, self.target.max_context,
                                                           self.target.vocab_size, self.eos_ids)
        if drafter != "none" and k + 1 not in self.target.widths:
            built = sorted(w - 1 for w in self.target.widths if w > 1)
            raise RequestError(f"k={k} has no verify graph in this engine (built for k in {built}): "
                               f"use one of those or re-export with graphs.k_values including {k}")
        return params, max_new, seed, drafter, k

    def constraint(self, request: GenerateRequest) -> Constraint | None:
        """The request's grammar state (None without json_schema / grammar / regex). The grammar
        is compiled once per distinct text and kept; RequestError with the parser's message."""
        try:
            spec = grammar_spec(request.json_schema, request.grammar, request.regex)
            return None if spec is None else self.grammars.constraint(*spec)
        except GrammarError as err:
            raise RequestError(str(err)) from None

    def validate(self, request: GenerateRequest) -> None:
        """Raise RequestError for a request generate() would refuse on its fields, without running
        anything (a tokenization, a grammar compile that is kept): the node answers such requests
        before they take a queue slot, and compiles their grammars off the worker's loop."""
        self.resolve(request)
        check_stop(request.stop)
        self.prompt_ids(request)
        self.constraint(request)

    def generate(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult:
        """Serve one request. Raises RequestError for a bad request (nothing is run).
        on_text(delta, n_tokens) receives each piece of safe-to-show text and the number of tokens
        generated so far; cancel() is asked between speculative steps. queued: requests in the
        caller's queue as this one starts, itself included: the load serve.speculate_k_by_load gives
        a k for (a smaller k, or 0: target-only; greedy output is the same; the result says why)."""
        params, max_new, seed, drafter_name, asked = self.resolve(request)
        table = self.cfg.serve.speculate_k_by_load
        k = speculation_policy.k_at(table, queued, asked) if drafter_name != "none" else asked
        off_reason = speculation_policy.serial_reason(drafter_name, queued, asked, k, table)
        policy_off = drafter_name != "none" and k == 0
        if policy_off:
            drafter_name = "none"
        check_stop(request.stop)
        prompt_ids = self.prompt_ids(request)
        constraint = self.constraint(request)
        forced = self.cfg.speculative.forced_drafts if request.forced_drafts is None else request.forced_drafts
        # forced drafts are speculation too: off with speculate=false and where the load policy says 0
        forced = constraint is not None and forced and request.speculate and not policy_off \
            and k + 1 in self.target.widths
        with self._lock:
            drafter = None if drafter_name == "none" else self._drafters.drafter(drafter_name)
            if drafter is not None:  # heads built for at most some k
                try:
                    drafter.check_k(k)
                except ConfigError as err:
                    raise RequestError(str(err)) from None
            decoder = StreamDecoder(self.tokenizer, tuple(request.stop))
            emit = text_emitter(decoder, on_text)
            reuse = self.cfg.serve.reuse_prefix
            try:
                new_ids, finish, stats = speculative.generate(
                    self.target, prompt_ids, max_new_tokens=max_new, eos_ids=self.eos_ids, sampling=params,
                    seed=seed, drafter=drafter, k=k, emit=emit, cancel=cancel, constraint=constraint,
                    forced_drafts=forced, reuse=reuse)
            except BaseException:
                self._drafters.forget()  # whatever the caches hold now, the next request runs cold
                raise
        tail = decoder.finish()
        if tail and on_text is not None:
            on_text(tail, len(decoder.ids))
        if finish == "stop":
            new_ids = self._trim_to_stop(new_ids, request.stop)
        return GenerateResult(text=decoder.text, token_ids=new_ids, finish_reason=finish, stats=stats,
                              prompt_tokens=len(prompt_ids), queued_at_start=queued,
                              speculation_off_reason=off_reason, message=incomplete_message(constraint, finish, max_new))

    def warm(self, system_prompt: str = "") -> int:
        """Prefill the chat prefix every request with this system prompt ("" = serve.system_prompt,
        then the template's default) shares, so the next such request reuses it (serve.reuse_prefix).
        Returns its length in tokens."""
        if not self.cfg.serve.reuse_prefix:
            raise ConfigError("warming the cache needs serve.reuse_prefix: true")
        one, two = (self.prompt_ids(GenerateRequest(prompt=p, system_prompt=system_prompt)) for p in ("a", "b"))
        shared = list(one[:common_prefix(one, two, len(one))])
        with self._lock:
            reused = common_prefix(self.target.held, shared, len(shared) - 1)
            self.target.held = ()
            if shared:
                self.target.prefill(shared[reused:], reused)
                self.target.held = tuple(shared)
        return len(shared)

    def _trim_to_stop(self, ids: list[int], stops: tuple[str, ...]) -> list[int]:
        """The shortest prefix of ids whose text contains a stop string (what plain decoding,
        checking after every token, would have stopped at)."""
        for n in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n])
            if any(stop and stop in text for stop in stops):
                return ids[:n]
        return ids

    def info(self) -> dict:
        return {"backend": self.cfg.runtime.backend, "model": self.model_cfg.name,
                "max_context": self.target.max_context, "k_values": sorted(w - 1 for w in self.target.widths if w > 1),
                "drafter": self.cfg.speculative.drafter, "k": self.cfg.speculative.k,
                "speculate_k_by_load": list(self.cfg.serve.speculate_k_by_load),
                "speculation_policy": speculation_policy.describe(self.cfg.serve.speculate_k_by_load)}

    def close(self) -> None:
        """Drop the runners (and with them the sessions and caches)."""
        self.target = None
        self._drafters = None

"""The engine: one target model (and its drafters) behind a request -> result call (ONNX Runtime; on
runtime.backend tensorrt, Engine.from_config returns backends/edgellm.py's EdgeLLMEngine instead: both are
a serving.RequestBackend).

This is what the CLI and the ROS node use, for every graphs.batch_slots = B. It checks a request, renders
the chat prompt, and turns tokens into text (streamed, UTF-8 safe, stop strings honoured). It owns one
loop (runtime/speculative.BatchLoop) over a target of B slots (drafting.slotted: an ort_runner.OrtRunner;
B=1 is a runner of one slot): start() turns a request into a SlotRequest the caller adds to the loop (the
node's worker admits requests into free slots and iterates the loop from one thread); generate() is
start() and the loop run with that request alone (the CLI's path). Each request drafts with its own
drafter, made for the slot it takes (runtime/drafting.py).

Prefix reuse (serve.reuse_prefix) is per slot: a request goes to the free slot whose cache holds the
longest prefix of its prompt; warm() prefills the system prompt's chat prefix into every free slot.
The load policy (serve.speculate_k_by_load): at each iteration a slot drafts the table's k at the load
(requests in the engine: occupied slots + the caller's queue), capped at its request's k; the result's
stats count the verify calls by k and the steps without speculation, and speculation_off_reason says
when the policy gave the request less than its k. speculative.k auto (the default): a request without
its own k drafts up to the largest exported k its drafter can propose, each iteration's k (0 included)
chosen by its runtime/k_choice.KChoice from its acceptance and the call costs measured as the engine loads
(starting from the estimates the previous request with the same drafter ended with).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from spec_edge import speculation_policy
from spec_edge.config import AUTO_K, Config, ConfigError
from spec_edge.graphs import plan
from spec_edge.runtime.backends.base import Runner, common_prefix
from spec_edge.runtime.backends.onnxruntime import ort_folder
from spec_edge.runtime.backends.slot_views import Slotted
from spec_edge.runtime.drafting import Drafters, refusal, slotted
from spec_edge.runtime import k_choice
from spec_edge.runtime.grammar import Constraint, GrammarError, Grammars, grammar_spec
from spec_edge.runtime.requests import GenerateRequest, GenerateResult, RequestError, check_fits, check_stop
from spec_edge.runtime.serving import RequestBackend, chat_text, resolve_fields
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.speculative import BatchLoop, Emit, SlotRequest
from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer


def text_emitter(decoder: StreamDecoder, on_text: Callable[[str, int], None] | None) -> Emit:
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
    """The loop over a target of B slots and the request handling around it. runner: the slotted target
    the loop drives; targets: its slots as B=1 Runners (slot_views.SlotRunner; target = slot 0)."""
    concurrent = False  # one loop: the caller admits requests into it (start) and iterates it from one thread

    def __init__(self, cfg: Config, runner: Slotted, targets: list[Runner], tokenizer: Tokenizer, graph_dir: Path,
                 progress: Callable[[str], None] = print):
        self.cfg = cfg
        self.runner, self.targets, self.target = runner, targets, targets[0]
        self.tokenizer = tokenizer
        self.graph_dir = graph_dir
        self.progress = progress
        self.model_cfg = plan.read_model_config(graph_dir)
        self.eos_ids = tuple(self.model_cfg.eos_ids)
        eos_text_id = tokenizer.token_id(tokenizer.eos_token) if tokenizer.eos_token else None
        if eos_text_id is not None and eos_text_id not in self.eos_ids:
            self.eos_ids += (eos_text_id,)
        self._drafters = Drafters(cfg, targets, tokenizer, graph_dir, self.model_cfg)
        self.grammars = Grammars(tokenizer, runner.vocab_size, self.eos_ids)
        self.loop = BatchLoop(runner, k_by_load=cfg.serve.speculate_k_by_load, reuse=cfg.serve.reuse_prefix)
        self._k_last: dict[str, k_choice.KChoice] = {}  # speculative.k auto: per drafter, the last request's choice
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[str], None] = print) -> RequestBackend:
        """Load the target (and a configured drafter) once from the folders the build made (spec_edge/artifacts.py,
        B > 1: with the graphs of several rows); a missing one is refused with the command that makes it.
        runtime.backend tensorrt: the Edge-LLM engines `spec-edge build` made, served end to end by
        backends/edgellm.py (the same request -> result calls as this class)."""
        if cfg.runtime.backend == "tensorrt":
            from spec_edge.runtime.backends.edgellm import EdgeLLMEngine

            return EdgeLLMEngine.from_config(cfg, progress)
        slots = cfg.graphs.batch_slots
        if cfg.speculative.drafter != "none" and (reason := refusal(cfg.speculative.drafter)):
            raise ConfigError(f"speculative.drafter: {reason}")
        graph_dir = ort_folder(cfg, "target")  # every graph of the plan, rows = 1 and rows > 1
        started = time.monotonic()
        runner, targets = slotted(cfg, graph_dir, slots)
        engine = cls(cfg, runner, targets, Tokenizer(graph_dir), graph_dir, progress)
        if cfg.speculative.drafter != "none":
            engine._drafters.load(cfg.speculative.drafter)  # now, not on the first request
        if cfg.speculative.k == AUTO_K:  # the call costs k_choice weighs (the slots' regions are empty now)
            engine.loop.costs = k_choice.measure_costs(runner)
            costs = k_choice.describe(engine.loop.costs, runner.step_width)
            progress(f"[engine] speculative.k auto: call costs {costs}")
        progress(f"[engine] {cfg.runtime.backend}, {slots} batch slot(s), ready in {time.monotonic() - started:.1f} s "
                 f"(max context {runner.max_context}, widths {sorted(runner.widths)})")
        return engine

    def drafter(self, name: str, slot: int = 0):
        """The drafter `name` (one of config.DRAFTERS but "none") for slot `slot`; what it runs on (a draft
        model, the layer-skip graphs, a head) is loaded on first use and kept."""
        return self._drafters.drafter(name, slot)

    # -- requests -------------------------------------------------------------------------
    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        text = chat_text(self.tokenizer, request, self.cfg.serve.system_prompt)
        ids = self.tokenizer.encode(text)
        limit = self.runner.max_context
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens but the context holds {limit} (prompt + answer): "
                               f"shorten the prompt or export with a larger graphs.max_context")
        if request.max_new_tokens is not None:  # as asked; the configured default adapts (context_full)
            check_fits(len(ids), int(request.max_new_tokens), limit)
        return ids

    def resolve(self, request: GenerateRequest) -> tuple[SamplingParams, int, int | None, str, int]:
        """(sampling, max_new_tokens, seed, drafter name, k) with config defaults filled in."""
        params, max_new, seed, drafter, k = resolve_fields(self.cfg, request, self.runner.max_context,
                                                           self.runner.vocab_size, self.eos_ids)
        if drafter != "none" and (reason := refusal(drafter)):
            raise RequestError(reason)
        if drafter != "none" and k + 1 not in self.runner.widths:
            built = sorted(w - 1 for w in self.runner.widths if w > 1)
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
        """Raise RequestError for a request start() would refuse on its fields, without running
        anything (a tokenization, a grammar compile that is kept): the node answers such requests
        before they take a queue slot, and compiles their grammars off the worker's loop."""
        self.resolve(request)
        check_stop(request.stop)
        self.prompt_ids(request)
        self.constraint(request)

    def start(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
              cancel: Callable[[], str | None] | None = None,
              on_result: Callable[[GenerateResult], None] | None = None) -> SlotRequest:
        """The SlotRequest of a request, for self.loop.add (raises RequestError for a bad one; nothing
        runs yet). on_text(delta, n_tokens) receives each piece of safe-to-show text and the number of
        tokens generated so far; cancel() is asked before each decode call; on_result(GenerateResult)
        is called from the loop's thread when the request leaves its slot."""
        params, max_new, seed, drafter_name, k = self.resolve(request)
        check_stop(request.stop)
        prompt_ids = self.prompt_ids(request)
        constraint = self.constraint(request)
        forced = self.cfg.speculative.forced_drafts if request.forced_drafts is None else request.forced_drafts
        # forced drafts are speculation too: off with speculate=false (the load policy sets each iteration's k)
        forced = constraint is not None and forced and request.speculate and k + 1 in self.runner.widths
        drafting = drafter_name != "none"
        speculating = k > 0 and (drafting or forced)
        choice = None
        if speculating and not request.k and self.cfg.speculative.k == AUTO_K:  # every exported k it can propose
            ks = [x for x in sorted(w - 1 for w in self.loop.verify_widths) if x <= k
                  and (not drafting or self._proposes(drafter_name, x))]
            if not ks:
                raise RequestError(f"speculative.k auto: drafter {drafter_name} can propose none of the exported k "
                                   f"{sorted(w - 1 for w in self.loop.verify_widths)}: send a k it can, or none")
            k, choice = ks[-1], k_choice.KChoice.after(self._k_last.get(drafter_name), ks)
        if drafting:  # loaded and checked now; the drafter itself is made for the slot the request takes
            self._drafters.check_k(drafter_name, self.loop.policy_ks(k))  # every k the load policy can give it
        table = self.loop.k_by_load
        decoder = StreamDecoder(self.tokenizer, tuple(request.stop))

        def done(new_ids: list[int], finish: str, stats) -> None:
            if choice is not None and drafting:
                self._k_last[drafter_name] = choice  # the next request with this drafter starts from it
            tail = decoder.finish()
            if tail and on_text is not None:
                on_text(tail, len(decoder.ids))
            if finish == "stop":
                new_ids = self._trim_to_stop(new_ids, request.stop)
            result = GenerateResult(text=decoder.text, token_ids=new_ids, finish_reason=finish, stats=stats,
                                    prompt_tokens=len(prompt_ids), queued_at_start=slot_request.occupancy,
                                    speculation_off_reason=speculation_policy.reason(stats, table, choice),
                                    message=incomplete_message(constraint, finish, max_new))
            if on_result is not None:
                on_result(result)

        def make_drafter(slot: int):
            return self._drafters.drafter(drafter_name, slot)

        slot_request = SlotRequest(prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=self.eos_ids,
                                   sampling=params, seed=seed, k=k if speculating else 0,
                                   make_drafter=make_drafter if drafting and speculating else None,
                                   emit=text_emitter(decoder, on_text), cancel=cancel, constraint=constraint,
                                   forced_drafts=forced, on_done=done, k_choice=choice)
        return slot_request

    def _proposes(self, drafter_name: str, k: int) -> bool:
        """Whether drafter drafter_name can propose k tokens (Medusa: its head count, P-EAGLE: its graphs)."""
        try:
            self._drafters.check_k(drafter_name, [k])
        except RequestError:
            return False
        return True

    def generate(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult:
        """Serve one request alone through the loop (the CLI's path; the node's worker runs many at once
        through start()). Raises RequestError for a bad request (nothing is run). queued: the load as it
        runs, itself included (the caller's queue: what serve.speculate_k_by_load gives a k for)."""
        out: list[GenerateResult] = []
        with self._lock:
            if self.loop.occupied:
                raise RuntimeError("generate() runs a request alone, but the loop is serving others (start())")
            slot_request = self.start(request, on_text, cancel, out.append)
            self.loop.waiting = queued - 1
            try:
                self.loop.add(slot_request)
                self.loop.run()
            except BaseException:
                self.loop.clear()  # the failed request leaves its slot (the loop emptied the prefix records)
                raise
            finally:
                self.loop.waiting = 0
        return out[0]

    def warm(self, system_prompt: str = "") -> int:
        """Prefill the chat prefix every request with this system prompt ("" = serve.system_prompt,
        then the template's default) shares once (into the free slot holding most of it already) and
        copy it into the other free slots' regions, so the next requests reuse it whichever slot they
        get (serve.reuse_prefix). Returns its length in tokens."""
        if not self.cfg.serve.reuse_prefix:
            raise ConfigError("warming the cache needs serve.reuse_prefix: true")
        one, two = (self.prompt_ids(GenerateRequest(prompt=p, system_prompt=system_prompt)) for p in ("a", "b"))
        shared = list(one[:common_prefix(one, two, len(one))])
        runner = self.runner
        with self._lock:
            free = [i for i, slot in enumerate(self.loop.slots) if slot is None]
            if not shared or not free:
                return len(shared)
            first = max(free, key=lambda i: (common_prefix(runner.held[i], shared, len(shared) - 1), -i))
            reused = common_prefix(runner.held[first], shared, len(shared) - 1)
            for i in free:
                runner.held[i] = ()
            runner.prefill(first, shared[reused:], reused)
            for i in free:
                if i != first:
                    runner.copy_prefix(first, i, len(shared))
                runner.held[i] = tuple(shared)
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
        return {"backend": self.cfg.runtime.backend, "model": self.model_cfg.name, "batch_slots": self.runner.batch,
                "max_context": self.runner.max_context, "k_values": sorted(w - 1 for w in self.runner.widths if w > 1),
                "drafter": self.cfg.speculative.drafter, "k": self.cfg.speculative.k,
                "speculate_k_by_load": list(self.cfg.serve.speculate_k_by_load),
                "speculation_policy": speculation_policy.describe(self.cfg.serve.speculate_k_by_load)} | (
            {"k_choice": "per request and iteration from its acceptance and the call costs: "
                         + k_choice.describe(self.loop.costs, self.runner.step_width)}
            if self.cfg.speculative.k == AUTO_K else {})

    def close(self) -> None:
        """Drop the runners (and with them the sessions and caches)."""
        self.runner = self.targets = self.target = self.loop = None
        self._drafters = None

"""The engine of graphs.batch_slots > 1: Engine's request handling (validation, chat prompt, sampling
defaults, streaming text, stop strings) in front of one BatchLoop (runtime/speculative.py), over ONNX Runtime's
BatchRunner (ONNX Runtime; on runtime.backend tensorrt, Edge-LLM's RequestEngine batches inside
backends/edgellm.py, which Engine.from_config returns for any graphs.batch_slots).

start() turns a request into a SlotRequest whose on_done hands the caller the same GenerateResult
Engine.generate returns; the caller (the node's batch worker, or generate() here) adds it to the loop
and iterates the loop from one thread. Each request drafts with its own drafter, made for the slot it
takes (runtime/slot_drafting.py): prompt lookup (ngram), the draft model, the EAGLE-3 head (eagle3,
hybrid), P-EAGLE and Medusa heads, each over its slot's own regions of the draft model's / head's
caches and its slot's target hidden states, so a slot drafts exactly what the request drafts alone
through the B=1 Engine; layerskip (the target's own first layers over the target's cache) is refused
with a message.

Prefix reuse (serve.reuse_prefix) is per slot: a request goes to the free slot whose cache holds the
longest prefix of its prompt (runtime/speculative.py); warm() prefills the system prompt's chat prefix into
every slot.

The speculation policy by occupancy: serve.speculate_k_by_load, the k of each iteration by the
occupied slots (speculation_policy.py; `spec-edge tune` measures it); a result's stats count its
verify calls by k and its steps without speculation, and speculation_off_reason says when the policy
gave it less than speculative.k.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from spec_edge import speculation_policy
from spec_edge.config import Config, ConfigError
from spec_edge.runtime.backends.base import common_prefix
from spec_edge.runtime.backends.onnxruntime import target_graphs
from spec_edge.runtime.backends.ort_batch import BatchRunner
from spec_edge.runtime.speculative import BatchLoop, SlotRequest
from spec_edge.runtime.engine import Engine, incomplete_message, text_emitter
from spec_edge.runtime.requests import GenerateRequest, GenerateResult, RequestError, check_stop
from spec_edge.runtime.slot_drafting import SLOT_DRAFTERS, SlotDrafters, refusal
from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer

BATCH_DRAFTERS = ("none",) + SLOT_DRAFTERS  # drafters a slot can run (each over its slot's own caches)


class BatchEngine(Engine):
    """An Engine whose target is a BatchRunner, served by .loop (one request per slot)."""

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[str], None] = print) -> "BatchEngine":
        if cfg.runtime.backend != "onnxruntime":
            raise ConfigError(f"BatchEngine runs ONNX Runtime's batch graphs; runtime.backend {cfg.runtime.backend} "
                              f"batches inside its own runtime: load it with Engine.from_config")
        reason = refusal(cfg.speculative.drafter, cfg.graphs.batch_slots)
        if reason:
            raise RequestError(f"speculative.drafter: {reason}")
        started = time.monotonic()
        graph_dir = target_graphs(cfg, progress)
        runner = BatchRunner(graph_dir, cfg.runtime.threads, slots=cfg.graphs.batch_slots)
        engine = cls(cfg, runner, Tokenizer(graph_dir), graph_dir, progress)
        engine.slot_drafters = SlotDrafters(cfg, runner, engine.tokenizer, graph_dir, engine.model_cfg, progress)
        k = cfg.speculative.k if cfg.speculative.drafter != "none" else 0
        engine.loop = BatchLoop(runner, k, k_by_load=cfg.serve.speculate_k_by_load, reuse=cfg.serve.reuse_prefix)
        if k:
            engine.slot_drafters.load(cfg.speculative.drafter)  # now, not on the first request
        progress(f"[engine] {cfg.runtime.backend}, {runner.batch} batch slots, ready in {time.monotonic() - started:.1f}"
                 f" s (max context {runner.max_context}, widths {sorted(runner.widths)})")
        return engine

    def start(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
              cancel: Callable[[], str | None] | None = None,
              on_result: Callable[[GenerateResult], None] | None = None) -> SlotRequest:
        """The SlotRequest of a request (raises RequestError for a bad one; nothing runs yet);
        on_result(GenerateResult) is called from the loop's thread when it leaves its slot."""
        params, max_new, seed, drafter_name, k = self.resolve(request)
        self._check_drafter(drafter_name)
        if drafter_name != "none" and k != self.loop.k:
            raise RequestError(f"the batched node verifies k={self.loop.k} drafts per call (speculative.k); "
                               f"send k=0 or k={self.loop.k}")
        check_stop(request.stop)
        prompt_ids = self.prompt_ids(request)
        constraint = self.constraint(request)
        forced = self.cfg.speculative.forced_drafts if request.forced_drafts is None else request.forced_drafts
        # forced drafts are speculation too: off with speculate=false (the load policy sets each iteration's k)
        forced = constraint is not None and forced and request.speculate and self.loop.k > 0
        drafting = drafter_name != "none" and self.loop.k > 0
        if drafting:  # loaded and checked now; the drafter itself is made for the slot the request takes
            self.slot_drafters.load(drafter_name)
            loop = self.loop  # every k the load policy can give it
            self.slot_drafters.check_k(drafter_name, {loop.k, *(min(loop.k, e) for e in loop.k_by_load)} - {0})
        decoder = StreamDecoder(self.tokenizer, tuple(request.stop))
        emit = text_emitter(decoder, on_text)

        def done(new_ids: list[int], finish: str, stats) -> None:
            tail = decoder.finish()
            if tail and on_text is not None:
                on_text(tail, len(decoder.ids))
            if finish == "stop":
                new_ids = self._trim_to_stop(new_ids, request.stop)
            off = speculation_policy.batch_reason(stats, self.loop.k_by_load, self.loop.k) if drafting else ""
            result = GenerateResult(text=decoder.text, token_ids=new_ids, finish_reason=finish, stats=stats,
                                    prompt_tokens=len(prompt_ids), queued_at_start=slot_request.occupancy,
                                    speculation_off_reason=off,
                                    message=incomplete_message(constraint, finish, max_new))
            if on_result is not None:
                on_result(result)

        def make_drafter(slot: int):
            return self.slot_drafters.drafter(drafter_name, slot)

        slot_request = SlotRequest(prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=self.eos_ids,
                                   sampling=params, seed=seed, make_drafter=make_drafter if drafting else None,
                                   emit=emit, cancel=cancel, constraint=constraint, forced_drafts=forced,
                                   on_done=done)
        return slot_request

    def _check_drafter(self, drafter_name: str) -> None:
        reason = refusal(drafter_name, self.loop.runner.batch)
        if reason:
            raise RequestError(reason)

    def validate(self, request: GenerateRequest) -> None:
        super().validate(request)
        self._check_drafter(self.resolve(request)[3])

    def generate(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult:
        """One request alone through the loop (the CLI's path; the node runs many at once)."""
        out: list[GenerateResult] = []
        with self._lock:
            self.loop.add(self.start(request, on_text, cancel, out.append))
            try:
                self.loop.run()
            except BaseException:
                self.loop.clear()  # the failed request leaves its slot (the loop emptied the prefix records)
                raise
        return out[0]

    def warm(self, system_prompt: str = "") -> int:
        """Engine.warm for every free slot: the chat prefix every request with this system prompt
        shares is prefilled once (into the free slot holding most of it already) and copied into the
        other free slots' regions, so the next requests reuse it whichever slot they get."""
        if not self.cfg.serve.reuse_prefix:
            raise ConfigError("warming the cache needs serve.reuse_prefix: true")
        one, two = (self.prompt_ids(GenerateRequest(prompt=p, system_prompt=system_prompt)) for p in ("a", "b"))
        shared = list(one[:common_prefix(one, two, len(one))])
        runner = self.loop.runner
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

    def info(self) -> dict:
        return dict(super().info(), batch_slots=self.loop.runner.batch)

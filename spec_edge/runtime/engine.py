"""The engine: one target model (and its drafters) behind a request -> result call on ONNX Runtime, a
serving.Decoder the scheduler drives (runtime.backend tensorrt: backends/edgellm.py's; runtime/decoders.py
opens the configured one).

This is what the CLI and the ROS node use, for every graphs.batch_slots = B. The scheduler's front
(runtime/front.py, over its capabilities) checks and prepares a request; the engine turns tokens into text (streamed, UTF-8 safe,
stop strings honoured). It owns one loop (runtime/speculative.BatchLoop) over a target of B slots
(drafting.slotted: an ort_runner.OrtRunner; B=1 is a runner of one slot): as a decoder, add(prepared, sink)
puts a request into a free slot (start() makes its SlotRequest) and iterate() is one loop iteration (the
scheduler admits requests and iterates from one thread; scheduler.run_one runs one alone). Each request drafts
with its own drafter, made for the slot it takes (runtime/drafting.py).

Prefix reuse (serve.reuse_prefix) is per slot: a request goes to the free slot whose cache holds the
longest prefix of its prompt; warm() prefills the system prompt's chat prefix into every free slot.
speculative.k auto (the default, the one way k is chosen here; serve.speculate_k_by_load is Edge-LLM's and
config.validate refuses it on ONNX Runtime): a request without
its own k drafts up to the largest exported k its drafter can propose, each iteration's k (0 included)
chosen by its runtime/k_choice.KChoice from its acceptance and the call costs measured as the engine loads
(starting from the estimates the previous request with the same drafter ended with); the result's stats
count the verify calls by k and the plain steps, and speculation_off_reason says when it ran below its k.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from spec_edge import speculation_policy
from spec_edge.config import AUTO_K, DRAFTERS, Config, ConfigError
from spec_edge.graphs import plan
from spec_edge.runtime.backends.base import common_prefix
from spec_edge.runtime.backends.onnxruntime import ort_folder
from spec_edge.runtime.backends.slot_views import SlotRunner, Slotted
from spec_edge.runtime.drafting import Drafters, needs, refusal, slotted
from spec_edge.runtime import k_choice
from spec_edge.runtime.front import Capabilities, ImagePrompt, Prepared
from spec_edge.runtime.grammar import Constraint, Grammars
from spec_edge.runtime.requests import GenerateResult
from spec_edge.runtime.serving import Sink
from spec_edge.runtime.speculative import BatchLoop, SlotRequest
from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer
from spec_edge.runtime.tool_format import Answer, ToolFormat


def incomplete_message(constraint: Constraint | None, finish: str, max_new: int) -> str:
    """The result's message when a guided output ended before it parses ("" otherwise)."""
    if constraint is None or finish == "eos" or constraint.complete:
        return ""
    return (f"finish_reason {finish}: the output is not complete under the {constraint.kind} (it does not parse yet"
            + (f"; raise max_new_tokens above {max_new})" if finish == "length" else ")"))


class InLoop:
    """A request in the loop: its speculative.SlotSink. Its tokens go as text (UTF-8 safe, stop strings cut) to its
    serving.Sink, its drafter (drafter: its name, "none" without) is made for the slot it takes, and its
    GenerateResult goes to the sink as it leaves; choice: its speculative.k auto KChoice."""

    def __init__(self, engine: Engine, prepared: Prepared, sink: Sink, drafter: str, choice: k_choice.KChoice | None):
        self.engine, self.prepared, self.sink, self.drafter_name, self.choice = engine, prepared, sink, drafter, choice
        self.text = StreamDecoder(engine.tokenizer, tuple(prepared.request.stop))
        self.answer = Answer(prepared.tool_format)  # with tools: the content streams without call markup

    def _send(self, delta: str) -> None:
        if delta := self.answer.push(delta):
            self.sink.on_text(delta, len(self.text.ids))

    def drafter(self, slot: int):
        return None if self.drafter_name == "none" else self.engine.drafter(self.drafter_name, slot)

    def emit(self, chunk: list[int]) -> bool:
        if delta := self.text.push(chunk):
            self._send(delta)
        return self.text.stopped

    def cancel_reason(self) -> str | None:
        return self.sink.cancel_reason()

    def done(self, request: SlotRequest, token_ids: list[int], finish: str, stats) -> None:
        prepared, choice = self.prepared, self.choice
        if choice is not None and self.drafter_name != "none":
            self.engine._k_last[self.drafter_name] = choice  # the next request with this drafter starts from it
        if tail := self.text.finish():
            self._send(tail)
        rest, text, calls, finish = self.answer.finish(self.text.text, finish)
        if rest:
            self.sink.on_text(rest, len(self.text.ids))
        self.sink.done(GenerateResult(
            text=text, token_ids=self.text.kept_ids(), finish_reason=finish, stats=stats, tool_calls=calls,
            prompt_tokens=len(request.prompt_ids), queued_at_start=request.occupancy,
            speculation_off_reason=speculation_policy.reason(stats, (), choice),
            message=incomplete_message(prepared.guide, finish, prepared.max_new_tokens)))


class Engine:
    """The loop over a target of B slots and the request handling around it. runner: the slotted target
    the loop drives; targets: its slots alone (slot_views.SlotRunner; target = slot 0)."""

    def __init__(self, cfg: Config, runner: Slotted, targets: list[SlotRunner], tokenizer: Tokenizer, graph_dir: Path,
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
        self.loop = BatchLoop(runner, reuse=cfg.serve.reuse_prefix)
        self.vision = None  # a vision target's image encoder (runtime/image_encoder.py)
        if plan.is_vision(cfg.model.target):
            from spec_edge.runtime.backends.onnxruntime import built
            from spec_edge.runtime.image_encoder import ImageEncoder

            self.vision = ImageEncoder(built(plan.vision_dir(cfg), "the vision encoder"), cfg.runtime.threads,
                                       cfg.serve.image_cache)
        self.capabilities = self._capabilities()
        self._k_last: dict[str, k_choice.KChoice] = {}  # speculative.k auto: per drafter, the last request's choice
        self.capacity = runner.batch  # requests at once: one per slot

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[str], None] = print) -> Engine:
        """Load the target (and a configured drafter) once from the folders the build made (spec_edge/artifacts.py,
        B > 1: with the graphs of several rows); a missing one is refused with the command that makes it."""
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
    def _capabilities(self) -> Capabilities:
        """What this engine serves (front.Front checks a request against it): every drafter whose model or head
        the config names, the k of its verify graphs, every guided kind and sampling feature."""
        built = tuple(sorted(w - 1 for w in self.runner.widths if w > 1))
        lacking = tuple((name, reason) for name in DRAFTERS
                        if (reason := needs(self.cfg, name, self._drafters.hidden_layers)))
        return Capabilities(name="ONNX Runtime", drafters=tuple(d for d in DRAFTERS if d not in dict(lacking)),
                            drafter_needs=lacking, k_values=built,
                            k_remedy="use one of those, or build its verify graph with this profile: "
                                     "`spec-edge export --k-values {k_values}` (graphs.k_values)",
                            max_context=self.runner.max_context, max_input=self.runner.max_context - 1,
                            vocab_size=self.runner.vocab_size, eos_ids=self.eos_ids,
                            drafter_k=self._drafters.k_limits([d for d in DRAFTERS if d not in dict(lacking)]),
                            images=self.cfg.model.max_images if self.vision is not None else 0,
                            image_prompt=None if self.vision is None else ImagePrompt(
                                self.vision.spec.image_text(), self.vision.spec.image_token_id,
                                self.vision.spec.image_tokens))

    def start(self, prepared: Prepared, sink: Sink) -> SlotRequest:
        """The SlotRequest of a prepared request (the front checked its drafter and k against self.capabilities),
        for self.loop.add; its output goes to sink (through an InLoop)."""
        request, drafter_name, k, constraint = prepared.request, prepared.drafter, prepared.k, prepared.guide
        drafting = drafter_name != "none"
        speculating = k > 0 and (drafting or prepared.forced_drafts)
        choice = None
        if speculating and not request.k and self.cfg.speculative.k == AUTO_K:  # every exported k it can propose
            able = self.capabilities.ks(drafter_name if drafting else "none", k)  # (the front refused an empty one)
            ks = [x for x in able if x + 1 in self.loop.verify_widths] or able  # (two-row step: k=1 pads a verify)
            k, choice = ks[-1], k_choice.KChoice.after(self._k_last.get(drafter_name), ks)
        made = drafter_name if drafting and speculating else "none"
        rows, mask = None, None
        if prepared.images:  # the image tokens' rows are the encoder's
            rows, mask = self.vision.rows(prepared.prompt_ids, prepared.images)
        return SlotRequest(prompt_ids=prepared.prompt_ids, max_new_tokens=prepared.max_new_tokens, eos_ids=self.eos_ids,
                           sampling=prepared.sampling, seed=prepared.seed, k=k if speculating else 0,
                           sink=InLoop(self, prepared, sink, made, choice), constraint=constraint,
                           forced_drafts=prepared.forced_drafts, k_choice=choice, image_rows=rows, image_mask=mask)

    # -- the decoder (serving.Decoder): the loop's slots --------------------------------------
    @property
    def occupied(self) -> int:
        return self.loop.occupied

    def guide(self, kind: str, text: str) -> Constraint:
        return self.grammars.constraint(kind, text)

    def tool_guide(self, fmt: ToolFormat, schemas: dict[str, dict], choice: str, parallel: bool) -> Constraint:
        return self.grammars.constraint("grammar", fmt.grammar(schemas, choice, parallel))

    def add(self, prepared: Prepared, sink: Sink, waiting: int) -> None:
        self.loop.waiting = waiting  # the load it starts at: occupied slots + waiting
        self.loop.add(self.start(prepared, sink))

    def iterate(self, waiting: int) -> None:
        self.loop.waiting = waiting
        self.loop.iterate()

    def clear(self) -> None:
        self.loop.clear()

    def warm(self, prefix_ids: list[int]) -> None:
        """Prefill a chat prefix many requests share (Front.shared_prefix) once (into the free slot holding most
        of it already) and copy it into the other free slots' regions, so the next requests reuse it whichever
        slot they get (serve.reuse_prefix)."""
        shared = list(prefix_ids)
        runner = self.runner
        free = [i for i, slot in enumerate(self.loop.slots) if slot is None]
        if not shared or not free:
            return
        first = max(free, key=lambda i: (common_prefix(runner.held[i], shared, len(shared) - 1), -i))
        reused = common_prefix(runner.held[first], shared, len(shared) - 1)
        for i in free:
            runner.held[i] = ()
        runner.prefill(first, shared[reused:], reused)
        for i in free:
            if i != first:
                runner.copy_prefix(first, i, len(shared))
            runner.held[i] = tuple(shared)

    def info(self) -> dict:
        return {"backend": self.cfg.runtime.backend, "model": self.model_cfg.name, "batch_slots": self.runner.batch,
                "max_context": self.runner.max_context, "k_values": sorted(w - 1 for w in self.runner.widths if w > 1),
                "drafter": self.cfg.speculative.drafter, "k": self.cfg.speculative.k,
                "suffix_store": self._drafters.suffix_store.memory()} | (
            {"image_encoder": self.vision.info()} if self.vision is not None else {}) | (
            {"k_choice": "per request and iteration from its acceptance and the call costs: "
                         + k_choice.describe(self.loop.costs, self.runner.step_width)}
            if self.cfg.speculative.k == AUTO_K else {})

    def close(self) -> None:
        """Write a persisted suffix store; drop the runners (and with them the sessions and caches)."""
        if self._drafters is not None:
            self._drafters.suffix_store.save()
        self.runner = self.targets = self.target = self.loop = None
        self._drafters = None

"""The engine: one target model (and its drafters) behind a request -> result call.

This is what the CLI and the ROS node use. It checks a request, renders the chat prompt, runs the
speculative loop and turns tokens into text (streamed, UTF-8 safe, stop strings honoured). It is
not re-entrant (one KV cache): callers serialise requests; a lock enforces it.
"""
from __future__ import annotations

import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spec_edge.graphs import export, ort_attention, quantize
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.base import BackendError, Runner
from spec_edge.config import Config, ConfigError, DRAFTERS
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.speculative import Stats
from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer

FINISH_REASONS = ("eos", "stop", "length", "context_full", "cancelled", "error")


class RequestError(ValueError):
    """A request that cannot be served as asked; the message says what to change."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); used instead of prompt when given
    system_prompt: str = ""                     # "" = config default, then the template's default
    max_new_tokens: int | None = None           # None = config default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculate: bool = True
    drafter: str | None = None
    k: int | None = None
    chat: bool = True                           # False: the prompt is fed as raw text


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_tokens: int = 0
    message: str = ""
    queued_at_start: int = 1         # requests in the caller's queue as it started, itself included
    speculation_off_reason: str = ""  # why it ran target-only though it would have speculated ("" = it did not)

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "message": self.message,
                "queued_at_start": self.queued_at_start, "speculation_off_reason": self.speculation_off_reason,
                "stats": self.stats.as_dict()}


def speculation_off_reason(drafter: str, queued: int, max_queue: int) -> str:
    """The load rule of serve.speculate_max_queue: "" when a request resolved to `drafter` speculates
    as asked, else why it runs target-only. queued: requests in the queue as it starts, itself
    included (1 = it is alone); max_queue: serve.speculate_max_queue, 0 = never switch off."""
    if drafter == "none" or max_queue <= 0 or queued <= max_queue:
        return ""
    return (f"{queued} requests queued (this one included) > serve.speculate_max_queue={max_queue}: "
            f"ran target-only instead of drafter {drafter}")


def _check_text(name: str, text: str) -> None:
    for i, char in enumerate(text):
        if char in "\n\t\r":
            continue
        category = unicodedata.category(char)
        if category == "Cs":
            raise RequestError(f"{name} is not valid UTF-8 (undecodable byte at character {i}): send UTF-8 text")
        if category == "Cc":
            raise RequestError(f"{name} contains control character U+{ord(char):04X} at character {i}: "
                               f"remove it (only newline, tab and carriage return are accepted)")


@dataclass
class _Drafters:
    draft_runner: Runner | None = None
    layer_skip: Runner | None = None
    eagle3_head: object | None = None  # backends.ort_heads.OrtEagle3Head, loaded on first use
    medusa_heads: object | None = None  # backends.ort_heads.OrtMedusaHeads
    peagle_head: object | None = None  # backends.ort_heads.OrtEagle3Head over a P-EAGLE export


class Engine:
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
        self._drafters = _Drafters()
        self._hidden_layers = export.returned_hidden_layers(graph_dir)  # what the target's graphs return
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config, progress: Callable[[str], None] = print) -> "Engine":
        """Load the target (and a configured draft model) once. On ONNX Runtime the graphs are
        exported first if missing or stale; TensorRT engines come from `spec-edge build`."""
        started = time.monotonic()
        graph_dir = export.artifact_dir(cfg, "target")
        draft_runner = None
        if cfg.runtime.backend == "tensorrt":
            from spec_edge.runtime.backends import tensorrt

            if not (graph_dir / "model.json").is_file():
                raise BackendError(f"no TensorRT build for profile '{cfg.runtime.profile}' ({graph_dir} is "
                                   f"missing): run `spec-edge build <profile>` on the device first")
            target, draft_runner = tensorrt.load_runners(cfg)
        else:
            graph_dir = ort_graphs(cfg, "target", export.export_model(cfg, "target", graph_dir, progress), progress)
            started = time.monotonic()
            target = load_runner(cfg, graph_dir)
        engine = cls(cfg, target, Tokenizer(graph_dir), graph_dir, progress)
        engine._drafters.draft_runner = draft_runner
        if cfg.speculative.drafter != "none":
            engine._drafter(cfg.speculative.drafter)  # load it now, not on the first request
        progress(f"[engine] {cfg.runtime.backend} ready in {time.monotonic() - started:.1f} s "
                 f"(max context {target.max_context}, verify widths {sorted(target.widths)})")
        return engine

    # -- drafters -------------------------------------------------------------------------
    def _drafter(self, name: str):
        from spec_edge.runtime.drafters.draft_model import ModelDrafter
        from spec_edge.runtime.drafters.layer_skip import LayerSkipDrafter
        from spec_edge.runtime.drafters.ngram import NgramDrafter

        spec = self.cfg.speculative
        if name == "ngram":
            return NgramDrafter(ngram_min=spec.ngram_min, ngram_max=spec.ngram_max)
        if name == "layerskip":
            if self._drafters.layer_skip is None:
                self._drafters.layer_skip = self.target.layer_skip(self.cfg.graphs.layer_skip_layers)
            return LayerSkipDrafter(self._drafters.layer_skip, self.cfg.graphs.layer_skip_layers)
        if name == "draft":
            if self._drafters.draft_runner is None:
                if not self.cfg.model.draft:
                    raise RequestError("drafter 'draft' needs a draft model: set model.draft in the config")
                if self.cfg.runtime.backend == "tensorrt":
                    raise RequestError("the draft model's engine is loaded only when speculative.drafter is "
                                       "'draft' in the profile: set it and restart")
                draft_dir = export.export_model(self.cfg, "draft", export.artifact_dir(self.cfg, "draft"),
                                                self.progress)
                check_same_tokenizer(Tokenizer(draft_dir), self.tokenizer, self.cfg.model.draft)
                draft_dir = ort_graphs(self.cfg, "draft", draft_dir, self.progress)
                self._drafters.draft_runner = load_runner(self.cfg, draft_dir)
            return ModelDrafter(self._drafters.draft_runner)
        if name == "eagle3":
            return self._eagle3_drafter()
        if name == "hybrid":
            from spec_edge.runtime.drafters.hybrid import HybridDrafter

            return HybridDrafter(NgramDrafter(ngram_min=spec.ngram_min, ngram_max=spec.ngram_max),
                                 self._eagle3_drafter("hybrid"))
        if name == "medusa":
            return self._medusa_drafter()
        if name == "peagle":
            return self._peagle_drafter()
        raise RequestError(f"unknown drafter '{name}': use one of {', '.join(DRAFTERS)}")

    def _eagle3_drafter(self, name: str = "eagle3"):
        from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter

        head = self._drafters.eagle3_head
        if head is None:
            head_path = self.cfg.speculative.eagle3_head
            if not head_path:
                raise RequestError(f"drafter {name} needs an EAGLE-3 head: set speculative.eagle3_head to a head "
                                   f"folder (e.g. one made by `spec-edge train-draft`) and restart")
            if self.cfg.runtime.backend != "onnxruntime":
                raise RequestError(f"the {name} drafter runs on the onnxruntime backend only so far")
            from spec_edge.heads import eagle3
            from spec_edge.runtime.backends.ort_heads import OrtEagle3Head, target_embedding

            self.target.hidden_states(0, 0)  # raises when the target graphs lack the hidden outputs
            head_dir = eagle3.export_head(self.cfg, head_path, self.model_cfg,
                                          export.artifact_dir(self.cfg, "eagle3"), self.progress)
            head_dir = ort_attention.for_config(self.cfg, head_dir, self.progress)
            head_dir = quantize.for_head(self.cfg, head_dir, self.progress)
            head = OrtEagle3Head(head_dir, target_embedding(self.graph_dir), self.cfg.runtime.threads)
            self._drafters.eagle3_head = head
        return Eagle3Drafter(self.target, head, self._columns(head.cfg.aux_layers))

    def _export_head(self, name: str, field: str, what: str, export_head) -> Path:
        """The configured head folder of a hidden-state drafter exported into its artifact folder by
        export_head (e.g. medusa.export_heads), or a RequestError saying what is missing."""
        path = getattr(self.cfg.speculative, field)
        if not path:
            raise RequestError(f"drafter {name} needs {what}: set speculative.{field} to a head folder (e.g. one "
                               f"made by `spec-edge train-draft --kind {name}`) and restart")
        if self.cfg.runtime.backend != "onnxruntime":
            raise RequestError(f"the {name} drafter runs on the onnxruntime backend only so far")
        self.target.hidden_states(0, 0)  # raises when the target graphs lack the hidden outputs
        head_dir = export_head(self.cfg, path, self.model_cfg, export.artifact_dir(self.cfg, name), self.progress)
        return quantize.for_head(self.cfg, head_dir, self.progress)

    def _medusa_drafter(self):
        from spec_edge.runtime.drafters.medusa import MedusaDrafter

        heads = self._drafters.medusa_heads
        if heads is None:
            from spec_edge.heads import medusa
            from spec_edge.runtime.backends.ort_heads import OrtMedusaHeads

            heads = OrtMedusaHeads(self._export_head("medusa", "medusa_head", "Medusa heads", medusa.export_heads),
                                   self.cfg.runtime.threads)
            if self.cfg.speculative.drafter == "medusa":
                MedusaDrafter(self.target, heads).check_k(self.cfg.speculative.k)  # the profile's k must fit
            self._drafters.medusa_heads = heads
        return MedusaDrafter(self.target, heads, self._columns((self.model_cfg.n_layers,)))

    def _peagle_drafter(self):
        from spec_edge.runtime.drafters.peagle import PEagleDrafter

        head = self._drafters.peagle_head
        if head is None:
            from spec_edge.heads import peagle
            from spec_edge.runtime.backends.ort_heads import OrtEagle3Head, target_embedding

            head_dir = self._export_head("peagle", "peagle_head", "a parallel-drafting head", peagle.export_head)
            head = OrtEagle3Head(head_dir, target_embedding(self.graph_dir), self.cfg.runtime.threads)
            self._drafters.peagle_head = head
        return PEagleDrafter(self.target, head, self._columns(head.cfg.aux_layers))

    def _columns(self, layers: tuple[int, ...]):
        """Where a head's layers sit in the target's hidden-state rows (union of all heads' layers)."""
        return export.hidden_columns(self._hidden_layers, tuple(layers), self.model_cfg.hidden_size)

    # -- requests -------------------------------------------------------------------------
    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.messages:
            messages = list(request.messages)
            for role, content in messages:
                _check_text(f"message ({role})", content)
        else:
            if not request.prompt.strip():
                raise RequestError("prompt is empty: send the text to answer")
            _check_text("prompt", request.prompt)
            messages = [("user", request.prompt)]
        system = request.system_prompt or self.cfg.serve.system_prompt
        _check_text("system prompt", system)
        if system and not any(role == "system" for role, _ in messages):
            messages.insert(0, ("system", system))
        if not any(content.strip() for _, content in messages):
            raise RequestError("all messages are empty: send the text to answer")
        text = self.tokenizer.render_chat(messages) if request.chat else "\n".join(c for _, c in messages)
        ids = self.tokenizer.encode(text)
        limit = self.target.max_context
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens but the context holds {limit} (prompt + answer): "
                               f"shorten the prompt or export with a larger graphs.max_context")
        return ids

    def resolve(self, request: GenerateRequest) -> tuple[SamplingParams, int, int | None, str, int]:
        """(sampling, max_new_tokens, seed, drafter name, k) with config defaults filled in."""
        defaults = self.cfg.sampling
        params = SamplingParams(
            temperature=defaults.temperature if request.temperature is None else float(request.temperature),
            top_k=defaults.top_k if request.top_k is None else int(request.top_k),
            top_p=defaults.top_p if request.top_p is None else float(request.top_p))
        if not params.temperature >= 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
        limit = self.target.max_context - 1
        # the configured default adapts to a smaller context; an explicit request value must fit
        max_new = min(defaults.max_new_tokens, limit) if request.max_new_tokens is None \
            else int(request.max_new_tokens)
        if not 1 <= max_new <= limit:
            raise RequestError(f"max_new_tokens must be in [1, {limit}] (the context holds "
                               f"{self.target.max_context} tokens), got {max_new}")
        seed = defaults.seed if request.seed is None else int(request.seed)
        drafter = self.cfg.speculative.drafter if not request.drafter else request.drafter
        if drafter not in DRAFTERS:
            raise RequestError(f"unknown drafter '{drafter}': use one of {', '.join(DRAFTERS)}")
        if not request.speculate:
            drafter = "none"
        k = self.cfg.speculative.k if not request.k else int(request.k)
        if drafter != "none" and k + 1 not in self.target.widths:
            built = sorted(w - 1 for w in self.target.widths if w > 1)
            raise RequestError(f"k={k} has no verify graph in this engine (built for k in {built}): "
                               f"use one of those or re-export with graphs.k_values including {k}")
        return params, max_new, (seed if seed is not None and seed >= 0 else None), drafter, k

    def validate(self, request: GenerateRequest) -> None:
        """Raise RequestError for a request generate() would refuse on its fields, without running
        anything (a tokenization): the node answers such requests before they take a queue slot."""
        self.resolve(request)
        _check_stop(request.stop)
        self.prompt_ids(request)

    def generate(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult:
        """Serve one request. Raises RequestError for a bad request (nothing is run).
        on_text(delta, n_tokens) receives each piece of safe-to-show text and the number of tokens
        generated so far; cancel() is asked between speculative steps. queued: requests in the
        caller's queue as this one starts, itself included; above serve.speculate_max_queue the
        request runs target-only (greedy output is the same; the result says why)."""
        params, max_new, seed, drafter_name, k = self.resolve(request)
        off_reason = speculation_off_reason(drafter_name, queued, self.cfg.serve.speculate_max_queue)
        if off_reason:
            drafter_name = "none"
        _check_stop(request.stop)
        prompt_ids = self.prompt_ids(request)
        with self._lock:
            drafter = None if drafter_name == "none" else self._drafter(drafter_name)
            if drafter is not None and hasattr(drafter, "check_k"):  # heads built for at most some k
                try:
                    drafter.check_k(k)
                except ConfigError as err:
                    raise RequestError(str(err)) from None
            decoder = StreamDecoder(self.tokenizer, tuple(request.stop))

            def emit(chunk: list[int]) -> bool:
                delta = decoder.push(chunk)
                if delta and on_text is not None:
                    on_text(delta, len(decoder.ids))
                return decoder.stopped

            new_ids, finish, stats = speculative.generate(
                self.target, prompt_ids, max_new_tokens=max_new, eos_ids=self.eos_ids, sampling=params,
                seed=seed, drafter=drafter, k=k, emit=emit, cancel=cancel)
        tail = decoder.finish()
        if tail and on_text is not None:
            on_text(tail, len(decoder.ids))
        if finish == "stop":
            new_ids = self._trim_to_stop(new_ids, request.stop)
        return GenerateResult(text=decoder.text, token_ids=new_ids, finish_reason=finish, stats=stats,
                              prompt_tokens=len(prompt_ids), queued_at_start=queued,
                              speculation_off_reason=off_reason)

    def _trim_to_stop(self, ids: list[int], stops: tuple[str, ...]) -> list[int]:
        """The shortest prefix of ids whose text contains a stop string (what plain decoding,
        checking after every token, would have stopped at)."""
        for n in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n])
            if any(stop and stop in text for stop in stops):
                return ids[:n]
        return ids

    def info(self) -> dict:
        import resource

        return {"backend": self.cfg.runtime.backend, "model": self.model_cfg.name,
                "max_context": self.target.max_context, "k_values": sorted(w - 1 for w in self.target.widths if w > 1),
                "drafter": self.cfg.speculative.drafter, "k": self.cfg.speculative.k,
                "memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def close(self) -> None:
        """Drop the runners (and with them the sessions and caches)."""
        self.target = None
        self._drafters = _Drafters()


def _check_stop(stop: tuple[str, ...]) -> None:
    for item in stop:
        _check_text("stop string", item)


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer, draft_source: str) -> None:
    draft_vocab, target_vocab = draft.vocab(), target.vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for tok, idx in draft_vocab.items() if target_vocab.get(tok) != idx)
        raise ConfigError(f"draft model '{draft_source}' uses another tokenizer ({len(draft_vocab)} tokens, "
                          f"{differing} differ from the target's {len(target_vocab)}): a draft model must "
                          f"share the target's tokenizer")


def ort_graphs(cfg: Config, role: str, exported: Path, progress: Callable[[str], None]) -> Path:
    """The folder ONNX Runtime runs for an exported target or draft model: the post-export passes
    the config asks for (fused attention, spec_edge/ort_attention.py; for the target with
    graphs.weights q4 / q4_fp32act also the GGUF's 4-bit blocks, spec_edge/quantize.py)."""
    graph_dir = ort_attention.for_config(cfg, exported, progress)
    if role == "target" and cfg.graphs.weights != "fp32":
        graph_dir = quantize.for_config(cfg, graph_dir, progress)
    return graph_dir


def load_runner(cfg: Config, graph_dir: Path) -> Runner:
    """An ONNX Runtime runner over exported graphs (TensorRT runners come from load_runners)."""
    from spec_edge.runtime.backends.onnxruntime import OrtRunner

    return OrtRunner(graph_dir, cfg.runtime.threads)

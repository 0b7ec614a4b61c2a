"""The drafters of one engine, made from its config on first use and kept: the runners and heads
they need (a draft model's graphs, the layer-skip graphs, the EAGLE-3 / Medusa / P-EAGLE heads
exported and passed through the ONNX Runtime passes the config asks for) are loaded once; the
drafter objects themselves are cheap and made per request.

slots=B (the batched node, graphs.batch_slots > 1): the components are made with one cache region per
slot (the EAGLE-3 / P-EAGLE heads' OrtEagle3Head(slots=B), the draft model as a BatchRunner over its
B=1 export); runtime/slot_drafting.py makes each slot's drafter over views of its slot.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spec_edge.config import DRAFTERS, Config, ConfigError, ModelConfig
from spec_edge.graphs import export, hidden, ort_attention, quantize
from spec_edge.runtime.backends.base import Runner
from spec_edge.runtime.backends.onnxruntime import load_runner, ort_graphs
from spec_edge.runtime.requests import RequestError
from spec_edge.runtime.tokenizer import Tokenizer


class Drafters:
    """drafter(name) for one target (ONNX Runtime; runtime.backend tensorrt drafts inside Edge-LLM,
    backends/edgellm.py). State, loaded on first use: draft_runner, layer_skip (Runners),
    eagle3_head (ort_heads.OrtEagle3Head), peagle_head (ort_heads.OrtEagle3Head), medusa_heads (ort_heads.OrtMedusaHeads). slots > 1: see above
    (target: slot 0's view, for the checks; draft_runner: an ort_batch.BatchRunner)."""

    def __init__(self, cfg: Config, target: Runner, tokenizer: Tokenizer, graph_dir: Path, model_cfg: ModelConfig,
                 progress: Callable[[str], None] = print, draft_runner: Runner | None = None, slots: int = 1):
        self.cfg, self.target, self.tokenizer, self.progress = cfg, target, tokenizer, progress
        self.slots = slots
        self.graph_dir, self.model_cfg = graph_dir, model_cfg  # the target's graphs and geometry
        self.draft_runner = draft_runner
        self.layer_skip: Runner | None = None
        self.eagle3_head = None   # backends.ort_heads.OrtEagle3Head
        self.medusa_heads = None  # backends.ort_heads.OrtMedusaHeads
        self.peagle_head = None   # backends.ort_heads.OrtEagle3Head over a P-EAGLE export
        self.hidden_layers = hidden.returned_hidden_layers(graph_dir)  # what the target's graphs return

    def forget(self) -> None:
        """Mark every resident cache (target, draft model, heads) as holding nothing valid: the next
        request prefills from position 0 (serve.reuse_prefix off, or a request that failed). B=1 only:
        the batched node's records are per slot (each slot's drafter's forget(), runtime/speculative.py)."""
        for owner in (self.target, self.draft_runner, self.eagle3_head, self.peagle_head):
            if owner is not None:
                owner.held = ()

    def drafter(self, name: str):
        from spec_edge.runtime.drafters.draft_model import ModelDrafter
        from spec_edge.runtime.drafters.layer_skip import LayerSkipDrafter
        from spec_edge.runtime.drafters.ngram import NgramDrafter

        spec = self.cfg.speculative
        if name == "ngram":
            return NgramDrafter(ngram_min=spec.ngram_min, ngram_max=spec.ngram_max)
        if name == "layerskip":
            if self.layer_skip is None:
                self.layer_skip = self.target.layer_skip(self.cfg.graphs.layer_skip_layers)
            return LayerSkipDrafter(self.layer_skip, self.cfg.graphs.layer_skip_layers)
        if name == "draft":
            return ModelDrafter(self.draft_model())
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

    def draft_model(self) -> Runner:
        """The draft model's runner (loaded once; slots > 1: a BatchRunner over its B=1 export)."""
        if self.draft_runner is None:
            if not self.cfg.model.draft:
                raise RequestError("drafter 'draft' needs a draft model: set model.draft in the config")
            draft_dir = export.export_model(self.cfg, "draft", export.artifact_dir(self.cfg, "draft"),
                                            self.progress)
            check_same_tokenizer(Tokenizer(draft_dir), self.tokenizer, self.cfg.model.draft)
            draft_dir = ort_graphs(self.cfg, "draft", draft_dir, self.progress)
            if self.slots > 1:  # one region per slot, bound to the fused graphs' in-place cache outputs
                from spec_edge.runtime.backends.ort_batch import BatchRunner

                if export.read_model_config(draft_dir).qk_norm:
                    raise RequestError("the batched node runs the draft model with fused attention, which does not "
                                       "cover q/k norms (Qwen3): use another draft model, or graphs.batch_slots: 1")
                self.draft_runner = BatchRunner(draft_dir, self.cfg.runtime.threads, slots=self.slots)
            else:
                self.draft_runner = load_runner(self.cfg, draft_dir)
        return self.draft_runner

    def load_eagle3_head(self, name: str = "eagle3"):
        """The EAGLE-3 head (loaded once); name: the drafter that asked (eagle3 or hybrid)."""
        if self.eagle3_head is None:
            from spec_edge.heads import eagle3_export
            from spec_edge.runtime.backends.ort_heads import OrtEagle3Head, target_embedding

            head_dir = self._export_head(name, "eagle3", "an EAGLE-3 head", eagle3_export.export_head,
                                         made_by="spec-edge train-draft", fused=True)
            self.eagle3_head = OrtEagle3Head(head_dir, target_embedding(self.graph_dir), self.cfg.runtime.threads,
                                             slots=self.slots)
        return self.eagle3_head

    def _eagle3_drafter(self, name: str = "eagle3"):
        from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter

        head = self.load_eagle3_head(name)
        return Eagle3Drafter(self.target, head, self.columns(head.cfg.aux_layers))

    def _export_head(self, name: str, kind: str, what: str, export_head, made_by: str = "",
                     fused: bool = False) -> Path:
        """The folder ONNX Runtime runs for the configured `kind` head (speculative.<kind>_head): exported
        into its artifact folder by export_head (e.g. medusa.export_heads), its attention fused when
        `fused` (EAGLE-3 heads), then graphs.head_weights' copy; or a RequestError saying what is
        missing. name: the drafter that asked; made_by: the command that makes such a head."""
        field = f"{kind}_head"
        path = getattr(self.cfg.speculative, field)
        if not path:
            made_by = made_by or f"spec-edge train-draft --kind {kind}"
            raise RequestError(f"drafter {name} needs {what}: set speculative.{field} to a head folder (e.g. one "
                               f"made by `{made_by}`) and restart")
        self.target.hidden_states(0, 0)  # raises when the target graphs lack the hidden outputs
        head_dir = export_head(self.cfg, path, self.model_cfg, export.artifact_dir(self.cfg, kind), self.progress)
        if fused:
            from spec_edge.heads.eagle3_export import read_head_config

            head_dir = ort_attention.for_config(self.cfg, head_dir, self.progress,
                                                read_head_config(head_dir).as_model_config())
        return quantize.for_head(self.cfg, head_dir, self.progress)

    def load_medusa_heads(self):
        """The Medusa heads (loaded once; no cache, so the batched node's slots share them)."""
        if self.medusa_heads is None:
            from spec_edge.heads import medusa
            from spec_edge.runtime.backends.ort_heads import OrtMedusaHeads
            from spec_edge.runtime.drafters.medusa import MedusaDrafter

            heads = OrtMedusaHeads(self._export_head("medusa", "medusa", "Medusa heads", medusa.export_heads),
                                   self.cfg.runtime.threads)
            if self.cfg.speculative.drafter == "medusa":
                MedusaDrafter(self.target, heads).check_k(self.cfg.speculative.k)  # the profile's k must fit
            self.medusa_heads = heads
        return self.medusa_heads

    def _medusa_drafter(self):
        from spec_edge.runtime.drafters.medusa import MedusaDrafter

        return MedusaDrafter(self.target, self.load_medusa_heads(), self.columns((self.model_cfg.n_layers,)))

    def load_peagle_head(self):
        """The P-EAGLE head (loaded once)."""
        if self.peagle_head is None:
            from spec_edge.heads import peagle
            from spec_edge.runtime.backends.ort_heads import OrtEagle3Head, target_embedding

            head_dir = self._export_head("peagle", "peagle", "a parallel-drafting head", peagle.export_head)
            self.peagle_head = OrtEagle3Head(head_dir, target_embedding(self.graph_dir), self.cfg.runtime.threads,
                                             slots=self.slots)
        return self.peagle_head

    def _peagle_drafter(self):
        from spec_edge.runtime.drafters.peagle import PEagleDrafter

        head = self.load_peagle_head()
        return PEagleDrafter(self.target, head, self.columns(head.cfg.aux_layers))

    def columns(self, layers: tuple[int, ...]):
        """Where a head's layers sit in the target's hidden-state rows (union of all heads' layers)."""
        return hidden.hidden_columns(self.hidden_layers, tuple(layers), self.model_cfg.hidden_size)


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer, draft_source: str) -> None:
    draft_vocab, target_vocab = draft.vocab(), target.vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for tok, idx in draft_vocab.items() if target_vocab.get(tok) != idx)
        raise ConfigError(f"draft model '{draft_source}' uses another tokenizer ({len(draft_vocab)} tokens, "
                          f"{differing} differ from the target's {len(target_vocab)}): a draft model must "
                          f"share the target's tokenizer")

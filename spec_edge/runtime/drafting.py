"""The drafters of one engine, made from its config on first use and kept, one way for every slot count
(graphs.batch_slots = B; B=1 is slot 0): the components they run on are loaded once with one cache region
per slot, and drafter(name, slot) makes a request's drafter over its slot's views (backends/slot_views.py),
so the drafter classes (runtime/drafters/*.py) run unchanged and a slot drafts exactly what the same
request drafts alone.

What each drafter runs on, per slot (loaded once, on first use; what a slot's drafter reads):
  ngram            nothing (the drafter object is per request)
  suffix           the engine's store of earlier answers (drafters/suffix.SuffixStore), one for every slot;
                   speculative.suffix_persist: kept in <engine_root>/<profile>/suffix_store.json (persisted())
  draft            the draft model with B regions (slotted(): an OrtRunner over its export with slots=B):
                   the slot's region, its record held there
  eagle3, hybrid   (hybrid: and its speculative.hybrid_lookup drafter, ngram or suffix, as above)
                   OrtEagle3Head(slots=B): the slot's cache region of the head (SlotHead, its own record);
                   the target's hidden states of the slot (the target's slot view)
  peagle           as eagle3, over the P-EAGLE head
  medusa           the heads have no cache: one OrtMedusaHeads for all slots, the slot's hidden states
  layerskip        the target's first n layers over the slot's own region of the target's cache: the
                   slot view's layer_skip (one layer-skip graph shared by the slots, OrtRunner.layer_skip)
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from spec_edge.config import DRAFTERS, Config, ConfigError, ModelConfig, engine_root, speculative_k
from spec_edge.graphs import hidden
from spec_edge.runtime.backends.onnxruntime import ort_folder
from spec_edge.runtime.backends.ort_runner import OrtRunner
from spec_edge.runtime.backends.slot_views import SlotHead, SlotRunner
from spec_edge.runtime.drafters.suffix import SuffixDrafter, SuffixStore
from spec_edge.runtime.requests import RequestError
from spec_edge.runtime.tokenizer import Tokenizer


def slotted(cfg: Config, graph_dir: Path, slots: int) -> tuple[OrtRunner, list[SlotRunner]]:
    """The model of graph_dir with one cache region per slot (an OrtRunner: the folder's rows > 1 graphs
    where it has them, the target's; a draft model's runs one-row calls), and each slot alone
    (its SlotRunner views)."""
    runner = OrtRunner(graph_dir, cfg.runtime.threads, slots=slots)
    return runner, [SlotRunner(runner, b) for b in range(slots)]


HEADS = {"eagle3": ("eagle3", "an EAGLE-3 head"), "hybrid": ("eagle3", "an EAGLE-3 head"),
         "peagle": ("peagle", "a parallel-drafting head"), "medusa": ("medusa", "Medusa heads")}  # drafter -> head


def needs(cfg: Config, name: str, hidden_layers: tuple[int, ...]) -> str | None:
    """What drafter `name` lacks to run on an engine of cfg whose target graphs return hidden_layers (None: it can
    run): data known at load, the one message the front refuses a request with."""
    if name == "draft" and not cfg.model.draft:
        return "drafter 'draft' needs a draft model: set model.draft in the config"
    if name in HEADS:
        kind, what = HEADS[name]
        if not getattr(cfg.speculative, f"{kind}_head"):
            return (f"drafter {name} needs {what}: set speculative.{kind}_head to a head folder (e.g. one made by "
                    f"`spec-edge-train --kind {kind}`) and restart")
        if not hidden_layers:
            return (f"drafter {name} reads the target's hidden states and its graphs were exported without them: "
                    f"re-export with speculative.{kind}_head set (`spec-edge export`)")
    return None


def refusal(name: str) -> str | None:
    """Why drafter `name` cannot run (None when it can; every drafter runs at any slot count): the one
    message the config, the engine and a request share."""
    if name not in DRAFTERS:
        return f"unknown drafter '{name}': use one of {', '.join(DRAFTERS)}"
    return None


class Drafters:
    """drafter(name, slot) for one target of B slots (ONNX Runtime; runtime.backend tensorrt drafts inside
    Edge-LLM, backends/edgellm.py). targets: the target's slot views (SlotRunners). State, loaded on
    first use: draft (the draft model's slot views), layer_skip (each slot's layer-skip SlotRunner), eagle3_head / peagle_head
    (ort_heads.OrtEagle3Head(slots=B)) and their SlotHead views, medusa_heads (ort_heads.OrtMedusaHeads)."""

    def __init__(self, cfg: Config, targets: list[SlotRunner], tokenizer: Tokenizer, graph_dir: Path,
                 model_cfg: ModelConfig):
        self.cfg, self.targets, self.tokenizer = cfg, targets, tokenizer
        self.slots = len(targets)
        self.graph_dir, self.model_cfg = graph_dir, model_cfg  # the target's graphs and geometry
        self.draft: list[SlotRunner] = []  # the draft model's slot views
        self.layer_skip: list[SlotRunner] = []  # each slot's layer-skip view
        self.eagle3_head = None   # backends.ort_heads.OrtEagle3Head
        self.medusa_heads = None  # backends.ort_heads.OrtMedusaHeads
        self.peagle_head = None   # backends.ort_heads.OrtEagle3Head over a P-EAGLE export
        self._heads: dict[str, list[SlotHead]] = {}  # "eagle3" / "peagle" -> the head's view per slot
        spec = cfg.speculative
        self.suffix_store = SuffixStore(spec.suffix_max_requests, spec.suffix_max_depth)  # every slot's past answers
        if spec.suffix_persist:
            self.suffix_store = persisted(cfg, graph_dir, model_cfg.vocab_size)
        self.hidden_layers = hidden.returned_hidden_layers(graph_dir)  # what the target's graphs return

    def load(self, name: str) -> None:
        """Load what drafter `name` runs on (once); RequestError saying what to change when it cannot run."""
        reason = refusal(name) or needs(self.cfg, name, self.hidden_layers)
        if reason:
            raise RequestError(reason)
        if name == "draft" and not self.draft:
            self.draft = self._draft_model()
        elif name == "layerskip" and not self.layer_skip:
            self.layer_skip = [target.layer_skip(self.cfg.graphs.layer_skip_layers) for target in self.targets]
        elif name in ("eagle3", "hybrid") and "eagle3" not in self._heads:
            head = self.load_eagle3_head(name)
            self._heads["eagle3"] = [SlotHead(head, b) for b in range(self.slots)]
        elif name == "peagle" and "peagle" not in self._heads:
            head = self.load_peagle_head()
            self._heads["peagle"] = [SlotHead(head, b) for b in range(self.slots)]
        elif name == "medusa":
            self.load_medusa_heads()

    def k_limits(self, names: Iterable[str]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """(drafter, the k it proposes, the refusal of another k) of those of names built for some k only, their
        heads loaded now: Medusa proposes k <= its head count, P-EAGLE the k of its draft graphs; the others any k."""
        limits = []
        if "medusa" in names:
            heads = self.load_medusa_heads()
            n = heads.n_heads
            limits.append(("medusa", tuple(range(1, n + 1)),
                           f"k={{k}} needs {{k}} Medusa heads; the heads in {heads.head_dir} have {n}: use k <= {n} "
                           "or train more heads (spec-edge-train --kind medusa --medusa-heads {k})"))
        if "peagle" in names:
            widths = tuple(self.load_peagle_head().draft_widths)
            limits.append(("peagle", widths, f"k={{k}} has no P-EAGLE draft graph (exported for k in {list(widths)}): "
                                             "add {k} to graphs.k_values and re-export"))
        return tuple(limits)

    def drafter(self, name: str, slot: int = 0):
        """A new drafter `name` (one of config.DRAFTERS but "none") for the request taking slot `slot`,
        over that slot's views."""
        from spec_edge.runtime.drafters.draft_model import ModelDrafter
        from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter
        from spec_edge.runtime.drafters.hybrid import HybridDrafter
        from spec_edge.runtime.drafters.layer_skip import LayerSkipDrafter
        from spec_edge.runtime.drafters.medusa import MedusaDrafter
        from spec_edge.runtime.drafters.ngram import NgramDrafter
        from spec_edge.runtime.drafters.peagle import PEagleDrafter

        self.load(name)
        spec, target = self.cfg.speculative, self.targets[slot]
        if name == "ngram":
            return NgramDrafter(ngram_min=spec.ngram_min, ngram_max=spec.ngram_max)
        if name == "suffix":
            return SuffixDrafter(self.suffix_store, spec.suffix_max_depth, spec.suffix_spec_factor, spec.suffix_min_prob)
        if name == "layerskip":
            return LayerSkipDrafter(self.layer_skip[slot], self.cfg.graphs.layer_skip_layers)
        if name == "draft":
            return ModelDrafter(self.draft[slot])
        if name == "medusa":
            return MedusaDrafter(target, self.medusa_heads, self.columns((self.model_cfg.n_layers,)))
        head = self._heads["peagle" if name == "peagle" else "eagle3"][slot]
        columns = self.columns(head.cfg.aux_layers)
        if name == "peagle":
            return PEagleDrafter(target, head, columns)
        if name == "eagle3":
            return Eagle3Drafter(target, head, columns)
        return HybridDrafter(self.drafter(spec.hybrid_lookup, slot), Eagle3Drafter(target, head, columns))

    def _draft_model(self) -> list[SlotRunner]:
        """The draft model's slot views (loaded once)."""
        draft_dir = ort_folder(self.cfg, "draft")
        check_same_tokenizer(Tokenizer(draft_dir), self.tokenizer, self.cfg.model.draft)
        return slotted(self.cfg, draft_dir, self.slots)[1]

    def load_eagle3_head(self, name: str = "eagle3"):
        """The EAGLE-3 head (loaded once); name: the drafter that asked (eagle3 or hybrid)."""
        if self.eagle3_head is None:
            from spec_edge.runtime.backends.ort_heads import OrtEagle3Head, target_embedding

            head_dir = ort_folder(self.cfg, "eagle3")
            self.eagle3_head = OrtEagle3Head(head_dir, target_embedding(self.graph_dir), self.cfg.runtime.threads,
                                             slots=self.slots)
        return self.eagle3_head

    def load_medusa_heads(self):
        """The Medusa heads (loaded once; no cache, so the batched node's slots share them)."""
        if self.medusa_heads is None:
            from spec_edge.runtime.backends.ort_heads import OrtMedusaHeads
            from spec_edge.runtime.drafters.medusa import MedusaDrafter

            heads = OrtMedusaHeads(ort_folder(self.cfg, "medusa"), self.cfg.runtime.threads)
            if self.cfg.speculative.drafter == "medusa":
                MedusaDrafter(self.targets[0], heads).check_k(speculative_k(self.cfg))  # the profile's k must fit
            self.medusa_heads = heads
        return self.medusa_heads

    def load_peagle_head(self):
        """The P-EAGLE head (loaded once)."""
        if self.peagle_head is None:
            from spec_edge.runtime.backends.ort_heads import OrtEagle3Head, target_embedding

            head_dir = ort_folder(self.cfg, "peagle")
            self.peagle_head = OrtEagle3Head(head_dir, target_embedding(self.graph_dir), self.cfg.runtime.threads,
                                             slots=self.slots)
        return self.peagle_head

    def columns(self, layers: tuple[int, ...]):
        """Where a head's layers sit in the target's hidden-state rows (union of all heads' layers)."""
        return hidden.hidden_columns(self.hidden_layers, tuple(layers), self.model_cfg.hidden_size)


def persisted(cfg: Config, graph_dir: Path, vocab_size: int) -> SuffixStore:
    """The suffix store kept in <engine_root>/<profile>/suffix_store.json, loaded (SuffixStore.load), stamped with
    the target's tokenizer (a hash of graph_dir's tokenizer.json)."""
    spec = cfg.speculative
    stamp = hashlib.sha256((graph_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
    path = engine_root(cfg) / cfg.runtime.profile / "suffix_store.json"
    store = SuffixStore(spec.suffix_max_requests, spec.suffix_max_depth, path, stamp)
    store.load(vocab_size)
    return store


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer, draft_source: str) -> None:
    draft_vocab, target_vocab = draft.vocab(), target.vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for tok, idx in draft_vocab.items() if target_vocab.get(tok) != idx)
        raise ConfigError(f"draft model '{draft_source}' uses another tokenizer ({len(draft_vocab)} tokens, "
                          f"{differing} differ from the target's {len(target_vocab)}): a draft model must "
                          f"share the target's tokenizer")

"""Each batch slot's drafter (graphs.batch_slots = B > 1): drafting.Drafters' components with one cache
region per slot, and the drafter of a slot made over views of its own regions (backends/slot_views.py),
so the drafter classes (runtime/drafters/*.py) run unchanged and a slot drafts exactly what the same
request drafts alone through the B=1 Engine.

What each drafter runs on, per slot (loaded once, on first use; what a slot's drafter reads):
  ngram            nothing (the drafter object is per request)
  draft            the draft model as a BatchRunner over its B=1 export with slots=B: the slot's region of
                   its cache, held[b] its record (SlotRunner)
  eagle3, hybrid   OrtEagle3Head(slots=B): the slot's cache region of the head (SlotHead, its own record);
                   the target's hidden states of the slot (SlotRunner over the batched target, whose graphs
                   return them when a head is configured: graphs/export.py graph_plan)
  peagle           as eagle3, over the P-EAGLE head
  medusa           the heads have no cache: one OrtMedusaHeads for all slots, the slot's hidden states
  layerskip        refused: it runs the target's own first layers over the target's cache, and the batched
                   target has no per-slot layer-skip graphs

The views of a slot are made once and kept, so a slot's records (prefix reuse of the draft model's and the
heads' caches) live as long as the slot. ONNX Runtime only (runtime.backend tensorrt batches inside Edge-LLM).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from spec_edge.config import Config, ConfigError, ModelConfig
from spec_edge.runtime.backends.slot_views import SlotHead, SlotRunner
from spec_edge.runtime.drafting import Drafters
from spec_edge.runtime.requests import RequestError
from spec_edge.runtime.tokenizer import Tokenizer

SLOT_DRAFTERS = ("ngram", "draft", "eagle3", "hybrid", "medusa", "peagle")  # drafters a batch slot can run


def refusal(drafter: str, batch_slots: int) -> str | None:
    """Why a batched node cannot run drafter (None when it can): the one message the config, the engine and
    a request share."""
    if drafter == "layerskip":
        return (f"drafter layerskip runs the target's own first layers over the target's cache, which has no "
                f"per-slot layer-skip graphs with graphs.batch_slots={batch_slots}: use one of "
                f"{', '.join(SLOT_DRAFTERS)} (or none), or graphs.batch_slots: 1 for layerskip")
    return None


class SlotDrafters:
    """drafter(name, slot) for the B slots of a batched target (ort_batch.BatchRunner)."""

    def __init__(self, cfg: Config, runner, tokenizer: Tokenizer, graph_dir: Path, model_cfg: ModelConfig,
                 progress: Callable[[str], None] = print):
        self.cfg, self.runner, self.batch = cfg, runner, runner.batch
        self.targets = [SlotRunner(runner, b) for b in range(self.batch)]  # the target's hidden states per slot
        # the components, with a cache region per slot (target: slot 0's view, for its checks)
        self.shared = Drafters(cfg, self.targets[0], tokenizer, graph_dir, model_cfg, progress, slots=self.batch)
        self._heads: dict[str, list[SlotHead]] = {}  # "eagle3" / "peagle" -> the head's view per slot
        self._draft: list[SlotRunner] = []           # the draft model's view per slot

    def load(self, name: str) -> None:
        """Load what drafter `name` runs on (once); RequestError saying what to change when it cannot run."""
        reason = refusal(name, self.batch)
        if reason:
            raise RequestError(reason)
        if name not in SLOT_DRAFTERS:
            raise RequestError(f"unknown drafter '{name}': a batch slot runs one of {', '.join(SLOT_DRAFTERS)}")
        if name == "draft" and not self._draft:
            runner = self.shared.draft_model()
            self._draft = [SlotRunner(runner, b) for b in range(self.batch)]
        elif name in ("eagle3", "hybrid") and "eagle3" not in self._heads:
            head = self.shared.load_eagle3_head(name)
            self._heads["eagle3"] = [SlotHead(head, b) for b in range(self.batch)]
        elif name == "peagle" and "peagle" not in self._heads:
            head = self.shared.load_peagle_head()
            self._heads["peagle"] = [SlotHead(head, b) for b in range(self.batch)]
        elif name == "medusa":
            self.shared.load_medusa_heads()

    def check_k(self, name: str, ks: Iterable[int]) -> None:
        """RequestError unless drafter name has graphs / heads for every k in ks (Medusa: head count,
        P-EAGLE: draft graphs) as Engine.generate checks the one k of a B=1 request."""
        probe = self.drafter(name, 0)  # a drafter object has no side effect until start()
        try:
            for k in ks:
                probe.check_k(k)
        except ConfigError as err:
            raise RequestError(str(err)) from None

    def drafter(self, name: str, slot: int):
        """A new drafter `name` for the request taking slot `slot`, over that slot's views."""
        from spec_edge.runtime.drafters.draft_model import ModelDrafter
        from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter
        from spec_edge.runtime.drafters.hybrid import HybridDrafter
        from spec_edge.runtime.drafters.medusa import MedusaDrafter
        from spec_edge.runtime.drafters.peagle import PEagleDrafter

        self.load(name)
        target, shared = self.targets[slot], self.shared
        if name == "ngram":
            return shared.drafter("ngram")
        if name == "draft":
            return ModelDrafter(self._draft[slot])
        if name == "medusa":
            return MedusaDrafter(target, shared.medusa_heads, shared.columns((shared.model_cfg.n_layers,)))
        head = self._heads["peagle" if name == "peagle" else "eagle3"][slot]
        columns = shared.columns(head.cfg.aux_layers)
        if name == "peagle":
            return PEagleDrafter(target, head, columns)
        if name == "eagle3":
            return Eagle3Drafter(target, head, columns)
        return HybridDrafter(shared.drafter("ngram"), Eagle3Drafter(target, head, columns))

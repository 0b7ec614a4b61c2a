"""The hybrid drafter (prompt lookup or the suffix drafter, else the EAGLE-3 head): greedy output == target-only
greedy with both sources drafting in one run, the head catching up on many pairs at once after n-gram drafts (in
chunks wider than its widest ingest graph) to the same drafts as a head fed from scratch, verify
outcomes routed to the source that drafted, sampling, the stats' name, and the config error."""
from __future__ import annotations

import pytest
from test_eagle3 import make_head

from spec_edge import artifacts
from spec_edge.runtime.serving import front_of
from spec_edge.config import DRAFTERS, ConfigError
from spec_edge.runtime import speculative
from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter
from spec_edge.runtime.drafters.hybrid import HybridDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.drafters.suffix import SuffixDrafter
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.sampling import Sampler
from speculated import assert_speculated
from tiny import Kept, assert_request_equals_plain, assert_sampling_follows_target, engine_with, plain, run_alone

REPEAT = "Ünïcödé 🤖 robot robot robot robot"  # lookup finds matches (the random target rarely agrees)
NO_REPEAT = "Move the arm to the left"


@pytest.fixture(scope="module")
def head_engine(tiny_models, tiny_cfg):
    head, _ = make_head(tiny_models["root"] / "head_hybrid", tiny_models["target"], scale=20.0)
    # the same target hidden outputs as test_eagle3's profile: its target graphs are reused
    return engine_with(tiny_cfg, {"runtime.profile": "tiny-eagle3", "speculative.eagle3_head": str(head),
                                  "speculative.drafter": "hybrid"})


def run(engine, drafter, prompt, k, max_new=48, **kwargs):
    ids = engine.tokenizer.encode(prompt)
    out, _, stats = run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=max_new, eos_ids=engine.eos_ids, drafter=drafter, k=k, **kwargs))
    return ids, out, stats


@pytest.mark.parametrize("k", [1, 3, 4])
def test_hybrid_greedy_equals_plain_both_sources(head_engine, k):
    drafter = head_engine.drafter("hybrid")
    assert isinstance(drafter, HybridDrafter)
    used = {"ngram": 0, "eagle3": 0}
    for prompt in [REPEAT, NO_REPEAT, "def add(a, b):"]:
        ids, out, stats = run(head_engine, drafter, prompt, k)
        assert out == plain(head_engine, ids, 48), f"k={k} prompt={prompt!r}"
        assert stats.drafter == "hybrid" and stats.verify_calls == sum(drafter.proposals.values())
        assert_speculated(stats, what=f"k={k} prompt={prompt!r} {drafter.proposals}")
        for source, n in drafter.proposals.items():
            used[source] += n
        if prompt == REPEAT:
            assert drafter.proposals["ngram"] > 0 and drafter.proposals["eagle3"] > 0, drafter.proposals
    assert used["ngram"] > 0 and used["eagle3"] > 0, used


def test_hybrid_through_engine_request(head_engine):
    assert_request_equals_plain(head_engine, "hybrid", 4)


def test_hybrid_with_the_suffix_lookup_equals_plain_both_sources(head_engine):
    """speculative.hybrid_lookup: suffix: the suffix drafter (its store of earlier answers) drafts before the head;
    each prompt asked twice, the second time drafted from the first answer: target-only output, both sources."""
    engine = artifacts.engine(head_engine.cfg.replace(**{"speculative.hybrid_lookup": "suffix"}),
                              progress=lambda message: None)
    drafter = engine.drafter("hybrid")
    assert isinstance(drafter.lookup, SuffixDrafter)
    used = {"suffix": 0, "eagle3": 0}
    for prompt in [NO_REPEAT, "def add(a, b):"] * 2:
        ids, out, stats = run(engine, drafter, prompt, 4)
        assert out == plain(head_engine, ids, 48), prompt
        assert_speculated(stats, what=f"{prompt!r} {drafter.proposals}")
        used = {source: used[source] + n for source, n in drafter.proposals.items()}
    assert used["suffix"] > 0 and used["eagle3"] > 0, used
    assert engine._drafters.suffix_store.memory()["answers"] == 4


class Scripted:
    """A lookup stand-in: proposes (a wrong guess) for the first `steps` calls, then nothing."""
    name = "ngram"

    def __init__(self, steps):
        self.steps, self.calls, self.observed = steps, 0, []

    def start(self, prompt_ids):
        self.calls, self.observed = 0, []

    def propose(self, seq, k, sampler):
        self.calls += 1
        return Draft(tokens=[seq[-1]] * k, q_draft=None) if self.calls <= self.steps else None

    def observe(self, n_proposed, n_accepted):
        self.observed.append((n_proposed, n_accepted))

    def check_k(self, k):
        pass

    def forget(self):
        pass

    def finish(self):
        pass


class Gap(Scripted):
    """EAGLE-3 drafts first (nothing here on call 1), then `steps` lookup drafts, then nothing again.
    The lookup drafts alternate between the target's own continuation (`oracle`, all accepted) and
    a wrong guess (rejected), so the head catches up over accepted and rolled-back verifies alike."""

    def __init__(self, steps, prompt_len, oracle):
        super().__init__(steps)
        self.prompt_len, self.oracle = prompt_len, oracle

    def propose(self, seq, k, sampler):
        self.calls += 1
        if not 2 <= self.calls <= self.steps + 1:
            return None
        if self.calls % 2:
            return Draft(tokens=[seq[-1]] * k, q_draft=None)
        done = len(seq) - self.prompt_len  # generated tokens so far, the pending one included
        tokens = self.oracle[done:done + k]
        return Draft(tokens=tokens + [0] * (k - len(tokens)), q_draft=None)


def test_head_catches_up_after_many_lookup_drafts(head_engine):
    """EAGLE-3 drafts from the prompt, lookup then drafts for 30 steps, then the head again: its
    first draft after the gap ingests every pair verified since its last draft in one call (more
    rows than its widest ingest graph, so chunked) and equals the draft of the same head fed the
    whole sequence from scratch. The run stops right after that draft, so the target's hidden rows
    below its position are still the verified ones for the reference."""
    k = 3
    eagle = head_engine.drafter("eagle3")
    head = eagle.head.head  # the head under slot 0's view (greedy_chain calls its ingest)
    ingested, seen = [], []  # (rows, position) per ingest call; (seq, draft) per EAGLE-3 draft
    real_ingest, real_propose = head.ingest, eagle.propose

    def ingest(tokens, hidden, position, slot=0):
        ingested.append((len(tokens), position))
        return real_ingest(tokens, hidden, position, slot)

    def propose(seq, k, sampler):
        draft = real_propose(seq, k, sampler)
        seen.append((list(seq), draft))
        return draft

    ids = head_engine.tokenizer.encode(NO_REPEAT)
    want = plain(head_engine, ids, 120)
    drafter = HybridDrafter(Gap(30, len(ids), want), eagle)
    head.ingest, eagle.propose = ingest, propose
    try:
        out, finish, stats = run_alone(head_engine.runner, speculative.SlotRequest(
            prompt_ids=ids, max_new_tokens=100, eos_ids=head_engine.eos_ids, drafter=drafter, k=k,
            sink=Kept(cancel=lambda: "cut" if len(seen) >= 2 else None)))
    finally:
        head.ingest, eagle.propose = real_ingest, real_propose
    assert finish == "cut" and out == want[:len(out)]
    assert_speculated(stats)
    assert stats.accepted >= 15 * k  # the oracle's drafts were all accepted
    assert drafter.proposals == {"ngram": 30, "eagle3": 2}
    (first_seq, _), (seq, catch_up) = seen
    rows, position = ingested[-1]  # the catch-up: every pair from the first draft's pending token on
    assert position == len(first_seq) - 1 and rows == len(seq) - len(first_seq)
    assert rows > max(head.ingest_widths), (rows, head.ingest_widths)
    fresh = Eagle3Drafter(head_engine.target, eagle.head, eagle.columns)
    fresh.forget()  # from scratch, not from the pairs the run left in the head's cache
    fresh.start(ids)
    reference = fresh.propose(seq, k, Sampler(SamplingParams()))
    assert reference.tokens == catch_up.tokens


def test_observe_goes_to_the_drafter_that_proposed():
    lookup, head = Scripted(2), Scripted(100)
    head.name = "eagle3"
    drafter = HybridDrafter(lookup, head)
    drafter.start([1, 2, 3])
    sampler = Sampler(SamplingParams())
    for n_accepted in (2, 1, 0, 3):
        assert drafter.propose([1, 2, 3, 4], 3, sampler) is not None
        drafter.observe(3, n_accepted)
    assert lookup.observed == [(3, 2), (3, 1)] and head.observed == [(3, 0), (3, 3)]
    assert drafter.proposals == {"ngram": 2, "eagle3": 2}


def test_real_lookup_stats_adapt_only_on_its_own_drafts():
    """A lookup match whose drafts keep failing falls below break-even and the head takes over; the
    head's verify outcomes never touch the lookup's per-length statistics."""
    head = Scripted(100)
    drafter = HybridDrafter(NgramDrafter(ngram_min=2, ngram_max=2), head)
    seq = [7, 8, 9, 7, 8]
    drafter.start(seq)
    sampler = Sampler(SamplingParams())
    sources = []
    for _ in range(6):
        drafter.propose(seq, 2, sampler)
        sources.append("ngram" if drafter._last is drafter.lookup else "eagle3")
        drafter.observe(2, 0)
    assert sources[0] == "ngram" and sources[-1] == "eagle3"
    assert drafter.lookup._gate._stats[2][1] == 1 + sources.count("ngram")  # prior + its own drafts only
    assert len(head.observed) == sources.count("eagle3")


def test_hybrid_sampling_mixes_deterministic_and_head_drafts(head_engine):
    """Sampling: lookup drafts go to verify one-hot (q_draft None), head drafts with their (k, V) rows."""
    drafter = head_engine.drafter("hybrid")
    forms = {"ngram": set(), "eagle3": set()}
    real = drafter.propose

    def propose(seq, k, sampler):
        draft = real(seq, k, sampler)
        if draft is not None:
            source = "ngram" if drafter._last is drafter.lookup else "eagle3"
            forms[source].add(None if draft.q_draft is None else draft.q_draft.shape)
        return draft

    drafter.propose = propose
    V = head_engine.target.vocab_size
    for seed in range(4):
        _, out, stats = run(head_engine, drafter, REPEAT, 3, max_new=40,
                            sampling=SamplingParams(temperature=0.7, top_k=5), seed=seed)
        assert len(out) > 0 and stats.drafter == "hybrid"
    assert forms["ngram"] == {None} and forms["eagle3"] == {(3, V)}, forms


class FirstStep(Scripted):
    """A lookup stand-in that drafts a fixed guess (deterministic, q_draft None) on its first call only."""

    def __init__(self, guess):
        super().__init__(1)
        self.guess = guess

    def propose(self, seq, k, sampler):
        self.calls += 1
        return Draft(tokens=self.guess[:k], q_draft=None) if self.calls == 1 else None


def test_hybrid_sampling_keeps_target_distribution(head_engine):
    """Speculative sampling over a lookup draft (one-hot) followed by head drafts (their q rows) in
    one request: the first three tokens follow the target's exact distribution (chi-square)."""
    from spec_edge.runtime.requests import GenerateRequest

    ids = front_of(head_engine).prompt_ids(GenerateRequest(prompt="Move the arm"))
    guess = plain(head_engine, ids, 4)[1:]  # the greedy continuation: often accepted at top_k=3
    eagle = head_engine.drafter("eagle3")
    head_drafts = []
    real = eagle.propose
    eagle.propose = lambda seq, k, sampler: head_drafts.append(seq) or real(seq, k, sampler)
    drafter = HybridDrafter(FirstStep(guess), eagle)
    assert_sampling_follows_target(head_engine, drafter, must_accept=True, k=3)
    assert head_drafts  # runs whose lookup draft was rejected went on with head drafts


def test_hybrid_without_head_is_a_clear_error(tiny_cfg):
    with pytest.raises(ConfigError, match="drafter=hybrid needs speculative.eagle3_head"):
        tiny_cfg.replace(**{"speculative.drafter": "hybrid"})
    with pytest.raises(ConfigError, match="speculative.hybrid_lookup: use ngram or suffix"):
        tiny_cfg.replace(**{"speculative.hybrid_lookup": "eagle3"})
    assert "hybrid" in DRAFTERS

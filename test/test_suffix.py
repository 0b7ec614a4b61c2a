"""The suffix drafter (runtime/drafters/suffix.py): its store's rules (longest match, most frequent continuation,
length from the match, probability floor, eviction, memory bound), and on tiny random models through the real loop:
greedy == target-only token for token and sampling the target's distribution, each proven to have speculated and
to have accepted drafts that only ANOTHER, earlier request's answer could give; in the batched loop (a shared
store, each slot its own part), with guided decoding (forced drafts on and off), tool calls and speculative.k auto;
the store kept across a restart (speculative.suffix_persist)."""
from __future__ import annotations

import json

import pytest
from speculated import assert_speculated
from tiny import Collect, Wrapped, assert_sampling_follows_target, engine_with, plain, run_alone

from spec_edge.runtime.serving import front_of
from spec_edge.config import ConfigError, engine_root
from spec_edge.http.metrics import Metrics
from spec_edge.runtime import speculative
from spec_edge.runtime.drafters.suffix import SuffixDrafter, SuffixStore
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one

PROMPTS = ["Move the arm to the left", "def add(a, b):", "Navigate to the kitchen and report the battery level.",
           "The robot picks up the red box"]


def store_with(*answers, max_requests=8, max_depth=32) -> SuffixStore:
    store = SuffixStore(max_requests, max_depth)
    for answer in answers:
        store.extend(store.open(), answer)
    return store


# -- the store's rules -------------------------------------------------------------------------------


def test_longest_match_wins_over_more_frequent_shorter_ones():
    store = store_with([1, 2, 3, 4, 5, 6, 7], [9, 3, 4, 8, 8], [9, 3, 4, 8, 8])
    # [2, 3, 4] occurs once (-> 5 6 7); [3, 4] three times, most often -> 8: the longest match decides
    assert store.propose([0, 2, 3, 4], 8, 1.0, 0.1) == ([5, 6, 7], 3.0, 3)


def test_most_frequent_continuation_and_probability_floor():
    store = store_with([1, 2, 7, 7], [1, 2, 7, 8], [1, 2, 7, 8], [1, 2, 5, 5])
    draft, score, _ = store.propose([0, 1, 2], 4, 2.0, 0.1)
    assert draft == [7, 8] and score == pytest.approx(0.75 + 0.5)  # D: 3/4, then 3/4 x 2/3
    assert store.propose([0, 1, 2], 4, 2.0, 0.6)[0] == [7]  # 0.5 < 0.6: the draft stops before the 8


def test_draft_length_from_the_match_length_and_k():
    store = store_with(list(range(1, 30)))
    assert store.propose([5, 6], 8, 1.0, 0.1)[0] == [7, 8]               # match 2 x factor 1
    assert store.propose([3, 4, 5, 6], 8, 1.0, 0.1)[0] == [7, 8, 9, 10]  # match 4
    assert store.propose([3, 4, 5, 6], 8, 1.5, 0.1)[0] == [7, 8, 9, 10, 11, 12]
    assert store.propose([1, 2, 3, 4, 5, 6], 3, 1.0, 0.1)[0] == [7, 8, 9]  # at most k
    assert store.propose([8, 5, 6], 8, 1.0, 0.1)[0] == [7, 8]  # the match stops where the context differs
    assert store.propose([6, 5], 8, 1.0, 0.1) == ([], 0.0, 0)  # no match


def test_the_store_is_bounded_and_evicts_the_oldest():
    store = SuffixStore(3, 32)
    for i in range(10):
        store.extend(store.open(), [100 + i, 1, 2, 3, 50 + i] * 4)
    memory = store.memory()
    assert (memory["answers"], memory["tokens"]) == (3, 60)
    # only the three newest answers are in the index: [1, 2, 3] continues with 57, 58 or 59 (the newest first)
    assert store.propose([1, 2, 3], 1, 1.0, 0.0)[0] == [59]
    assert all(entry >> 24 in store.lists for entries in store.index.values() for entry in entries)
    assert not any(key >> 20 in range(100, 107) for key in store.index)  # the evicted answers' keys are gone
    store.extend(1, [1, 2, 3])  # an evicted answer takes nothing
    assert store.memory()["tokens"] == 60
    assert Metrics().render(0, 0, 1, memory).count("spec_edge_suffix_store{") == 4


def test_a_request_drafts_from_its_prompt_and_from_other_answers_not_its_own_store_entry():
    store = SuffixStore(8, 32)
    first = SuffixDrafter(store, 32, 1.0, 0.1)
    first.start([1, 2, 3, 4])
    assert first.propose([1, 2, 3, 4, 1, 2], 4, None).tokens == [3, 4]  # its prompt (own part)
    first.propose([1, 2, 3, 4, 1, 2, 9, 8, 7], 4, None)
    first.finish()
    assert list(store.lists[1]) == [1, 2, 9, 8, 7]  # the output only, the last tokens taken at finish
    second = SuffixDrafter(store, 32, 1.0, 0.1)
    second.start([5, 5])
    assert second.propose([5, 5, 2, 9], 4, None).tokens == [8, 7]  # the first request's answer (store)
    assert second.store.propose([5, 5, 2, 9], 4, 1.0, 0.1, skip=second._answer)[0] == [8, 7]


def test_a_kind_of_match_that_does_not_pay_goes_silent_and_the_others_keep_drafting():
    store = store_with([7, 8, 1, 2, 3, 4])  # an earlier answer: after [7, 8] came 1 2 3 4
    drafter = SuffixDrafter(store, 32, 2.0, 0.1)
    drafter.start([5, 6, 9, 9])
    seq = [5, 6, 9, 9, 7, 8]
    for _ in range(3):  # the store's 2-token match drafts in full; the target takes none of it, three times
        assert drafter.propose(seq, 4, None).tokens == [1, 2, 3, 4]
        drafter.observe(4, 0)
    assert drafter.propose(seq, 4, None) is None  # 2 accepted per 4 proposals (prior 2 / 1): under break-even 0.6
    assert drafter.propose(seq + [5, 6], 4, None).tokens == [9, 9, 7, 8]  # its own prompt's match still drafts
    drafter.start([1])  # the next request tries every kind afresh
    assert drafter.propose([1, 7, 8], 4, None) is not None


def test_config_keys_and_refusals(tiny_cfg):
    assert tiny_cfg.replace(**{"speculative.drafter": "suffix", "speculative.suffix_max_requests": 4}) \
        .speculative.suffix_max_requests == 4
    for key, value in (("suffix_max_requests", 0), ("suffix_max_depth", 1), ("suffix_min_prob", 1.5),
                       ("suffix_spec_factor", 0.0)):
        with pytest.raises(ConfigError, match="speculative.suffix_"):
            tiny_cfg.replace(**{f"speculative.{key}": value})
    with pytest.raises(ConfigError, match="cannot run on runtime.backend=tensorrt"):
        tiny_cfg.replace(**{"runtime.backend": "tensorrt", "graphs.dtype": "float16", "graphs.weights": "fp32",
                            "speculative.drafter": "suffix", "speculative.k": 4})


# -- exactness through the real loop -----------------------------------------------------------------


class Sourced(Wrapped):
    """A SuffixDrafter that counts, per part the draft came from ("own": its request; "store": other answers), the
    drafts proposed and accepted tokens (a draft differing from what its own part alone proposes is the store's)."""

    def __init__(self, inner: SuffixDrafter):
        super().__init__(inner)
        self._last = None
        self.proposed = {"own": 0, "store": 0}
        self.accepted = {"own": 0, "store": 0}

    def propose(self, seq, k, sampler):
        draft = self.inner.propose(seq, k, sampler)
        if draft is not None:
            own = self.inner.own.propose(seq, k, self.inner.spec_factor, self.inner.min_prob)[0]
            self._last = "own" if own == draft.tokens else "store"
            self.proposed[self._last] += 1
        return draft

    def observe(self, n_proposed, n_accepted):
        self.accepted[self._last] += n_accepted


def test_greedy_equals_target_only_and_accepts_drafts_from_earlier_answers(tiny_engine):
    """The store holds the earlier answers to these prompts (as the engine records them: the outputs); asked again,
    each request is drafted from them and answers the target-only answer, with drafts from the store accepted;
    each request's own answer enters the store when it finishes."""
    answers = {prompt: plain(tiny_engine, tiny_engine.tokenizer.encode(prompt), 40) for prompt in PROMPTS}
    store = store_with(*answers.values(), max_requests=16)
    drafter = Sourced(SuffixDrafter(store, 32, 1.0, 0.1))
    for prompt in PROMPTS:
        got, _, stats = run_alone(tiny_engine.runner, speculative.SlotRequest(
            prompt_ids=tiny_engine.tokenizer.encode(prompt), max_new_tokens=40, eos_ids=tiny_engine.eos_ids,
            drafter=drafter, k=4))
        assert got == answers[prompt], prompt
        assert_speculated(stats, what=repr(prompt))
    assert drafter.accepted["store"] > 0, drafter.accepted  # a draft from ANOTHER request's answer, accepted
    assert store.memory()["answers"] == 2 * len(PROMPTS)


def test_sampling_keeps_the_target_distribution_with_drafts_from_earlier_answers(tiny_engine):
    drafter = Sourced(SuffixDrafter(SuffixStore(64, 32), 32, 1.0, 0.1))
    assert_sampling_follows_target(tiny_engine, drafter, must_accept=True, n=600)
    assert drafter.accepted["store"] > 0, drafter.accepted


@pytest.fixture(scope="module")
def batched(tiny_cfg):
    """The tiny profile over 3 slots, drafter suffix, speculative.k auto (each request's k per iteration)."""
    return engine_with(tiny_cfg, {"graphs.batch_slots": 3, "speculative.drafter": "suffix", "speculative.k": "auto"})


def test_batched_slots_share_the_store_and_answer_as_target_only(batched, tiny_engine):
    """Six requests (each prompt twice) through 3 slots joining at different iterations, k auto: each answers
    the target-only answer; the shared store holds every answer; drafts were verified and accepted."""
    prepared = [front_of(batched).prepare(GenerateRequest(prompt=p, max_new_tokens=40)) for p in PROMPTS + PROMPTS[:2]]
    join_at, sinks, waiting = [0, 0, 3, 9, 20, 30], [Collect() for _ in prepared], list(range(len(prepared)))
    before = batched._drafters.suffix_store.memory()["answers"]
    while waiting or batched.occupied:
        while waiting and join_at[waiting[0]] <= batched.loop.iterations and batched.loop.free:
            i = waiting.pop(0)
            batched.add(prepared[i], sinks[i], len(waiting))
        batched.iterate(len(waiting))
    for p, sink in zip(prepared, sinks):
        assert sink.result.token_ids == plain(tiny_engine, p.prompt_ids, 40)
        assert sink.result.stats.drafter == "suffix"
    for p, sink in zip(PROMPTS[:2], sinks[len(PROMPTS):]):  # asked again: drafted from the first answers
        assert_speculated(sink.result.stats, what=f"{p!r} asked again")
    assert batched._drafters.suffix_store.memory()["answers"] == before + len(prepared)
    assert batched.info()["suffix_store"]["tokens"] > 0


def test_guided_forced_drafts_and_tool_calls_equal_target_only(batched):
    """A JSON schema with and without grammar-forced drafts, and a Lark grammar (what a tool call runs under: the
    tiny context cannot hold a tool prompt; bench/robot_shift.py asks the real model for tool calls), each asked
    twice (the second time the first answer is in the store): the answer without speculation, token for token."""
    schema = json.dumps({"type": "object", "required": ["action", "speed"], "additionalProperties": False,
                         "properties": {"action": {"enum": ["pick", "place", "move"]},
                                        "speed": {"type": "integer", "minimum": 0, "maximum": 99}}})
    asks = [dict(prompt="Move the arm", json_schema=schema, forced_drafts=False),
            dict(prompt="Move the arm", json_schema=schema, forced_drafts=True),
            dict(prompt="Say it", grammar='root ::= "say(" ("yes" | "no" | "done") ")"')]  # a tool call's kind
    for ask in asks:
        base = run_one(batched, GenerateRequest(**ask, max_new_tokens=48, speculate=False))
        for i in range(2):
            got = run_one(batched, GenerateRequest(**ask, max_new_tokens=48, drafter="suffix"))
            assert (got.token_ids, got.finish_reason, got.tool_calls) == \
                (base.token_ids, base.finish_reason, base.tool_calls), ask
            if i == 1:  # asked again: the store holds the first answer (the first may find nothing to draft)
                assert_speculated(got.stats, what=f"{ask} asked again")


# -- persistence (speculative.suffix_persist) ----------------------------------------------------------


def test_a_persisted_store_survives_a_restart_and_drafts_the_first_request(tiny_cfg, tiny_engine):
    """Answers given before a restart (saved at close) draft, accepted, the first request after it."""
    settings = {"speculative.drafter": "suffix", "speculative.suffix_persist": True}
    (engine_root(tiny_cfg) / tiny_cfg.runtime.profile / "suffix_store.json").unlink(missing_ok=True)
    first = engine_with(tiny_cfg, settings)
    [run_one(first, GenerateRequest(prompt=prompt, max_new_tokens=40, drafter="suffix")) for prompt in PROMPTS]
    first.close()  # (the answers above only fill the store: the proof is the first request after the restart)
    again = engine_with(tiny_cfg, settings)
    store = again._drafters.suffix_store
    assert store.memory()["answers"] == len(PROMPTS)
    ids = front_of(again).prepare(GenerateRequest(prompt=PROMPTS[2], max_new_tokens=40)).prompt_ids  # as answered
    drafter = Sourced(SuffixDrafter(store, 32, 1.0, 0.1))
    got, _, stats = run_alone(again.runner, speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=40, eos_ids=again.eos_ids, drafter=drafter, k=4))
    assert got == plain(tiny_engine, ids, 40)
    assert_speculated(stats, what="the first request after the restart")
    assert drafter.accepted["store"] > 0, drafter.accepted  # drafted from an answer given before the restart
    store.path.unlink()


@pytest.mark.parametrize("kind", ["truncated", "garbage", "another tokenizer", "another format", "id out of vocab"])
def test_a_corrupt_or_foreign_store_file_is_ignored_with_a_warning(tmp_path, caplog, kind):
    path = tmp_path / "suffix_store.json"
    saved = SuffixStore(8, 32, path, "stamp")
    saved.extend(saved.open(), [1, 2, 3, 4, 5])
    saved.save()
    text, data = path.read_text(), json.loads(path.read_text())
    changes = {"truncated": text[:len(text) // 2], "garbage": "\x00\xff not json",
               "another tokenizer": json.dumps(data | {"stamp": "other"}),
               "another format": json.dumps(data | {"format": "spec_edge suffix store 0"}),
               "id out of vocab": json.dumps(data | {"answers": [[1, 2, 99]]})}
    path.write_text(changes[kind])
    store = SuffixStore(8, 32, path, "stamp")
    store.load(vocab_size=50)
    assert store.memory()["answers"] == 0
    assert str(path) in caplog.text and "ignored" in caplog.text, caplog.text
    caplog.clear()
    SuffixStore(8, 32, tmp_path / "absent.json", "stamp").load(vocab_size=50)
    assert not caplog.text  # no file (the first start): nothing to warn about


def test_serving_goes_on_over_a_corrupt_store_file(tiny_cfg, caplog):
    settings = {"speculative.drafter": "suffix", "speculative.suffix_persist": True}
    path = engine_root(tiny_cfg) / tiny_cfg.runtime.profile / "suffix_store.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": "spec_edge suffix store 1", "stamp": ')  # truncated
    engine = engine_with(tiny_cfg, settings)
    assert "ignored" in caplog.text and engine._drafters.suffix_store.memory()["answers"] == 0
    got = run_one(engine, GenerateRequest(prompt=PROMPTS[0], max_new_tokens=20, drafter="suffix"))
    base = run_one(engine, GenerateRequest(prompt=PROMPTS[0], max_new_tokens=20, speculate=False))
    assert got.token_ids == base.token_ids
    engine.close()
    assert json.loads(path.read_text())["answers"]  # the next save replaced it
    path.unlink()

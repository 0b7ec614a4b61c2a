"""Prefix reuse per batch slot (serve.reuse_prefix with graphs.batch_slots > 1) on tiny random models:
each slot keeps a record of what its cache region holds; a request goes to the free slot sharing the
longest prefix with its prompt (ties: the least recently taken), prefills only the rest, and answers exactly
what it answers cold, alone or beside others; after a cancel the record is kept, after a failure
every record is emptied; Engine.warm prefills the system prompt's chat prefix into every slot."""
from __future__ import annotations

import pytest
from test_batch import K, SLOTS, batch_cfg

from spec_edge.runtime.serving import front_of
from spec_edge.artifacts import model_graphs
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.base import common_prefix
from spec_edge.runtime.backends.ort_runner import OrtRunner
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
from tiny import Kept, drain, run_together, serve_together, warm

SYSTEM = "The robot picks up the red box and places it on the shelf."
TURNS = ["Move the arm to the left", "Navigate to the kitchen", "Report the battery level", "def add(a, b):"]


@pytest.fixture(scope="module")
def engine(tiny_cfg):
    """The Engine over the tiny batched graphs (test_batch's folder), serve.reuse_prefix on."""
    from spec_edge import artifacts

    return artifacts.engine(batch_cfg(tiny_cfg), progress=lambda message: None)


@pytest.fixture(scope="module")
def cold(tiny_cfg):
    """A second runner over the same graphs (its own cache), for the cold answers."""
    return OrtRunner(model_graphs(batch_cfg(tiny_cfg), "target", progress=lambda message: None), slots=SLOTS)


def ids_of(engine, turn: str, system: str = SYSTEM) -> list[int]:
    return front_of(engine).prompt_ids(GenerateRequest(prompt=turn, system_prompt=system))


def request(ids: list[int], max_new: int = 16, eos_ids: tuple[int, ...] = (), **fields) -> speculative.SlotRequest:
    return speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=max_new, eos_ids=eos_ids, k=K, drafter=NgramDrafter(), **fields)


def cold_answer(cold, ids, max_new: int = 16, eos_ids: tuple[int, ...] = ()) -> list[int]:
    cold.held = [()] * SLOTS
    ids_out, _, stats = run_together(cold, [request(ids, max_new, eos_ids)])[0]
    assert stats.prompt_tokens_reused == 0
    return ids_out


def test_slot_affinity_and_reused_equals_cold(engine, cold):
    """Requests over the four slots, one after another and together: each goes to the free slot whose
    record shares most of its prompt (ties: the least recently taken), prefills only from there, and equals
    its cold answer; reuse=False (serve.reuse_prefix off) makes every request cold, lowest free slot."""
    runner = engine.loop.runner
    loop = speculative.BatchLoop(runner, reuse=True)
    loop.clear()  # every record empty
    p = [ids_of(engine, turn) for turn in TURNS]
    answers: dict = {}

    def add(ids, key):
        answers[key] = Kept()
        return loop.add(request(ids, sink=answers[key]))

    assert add(p[0], "a") == 0  # all records empty: the lowest index
    drain(loop)
    assert add(p[1], "b") == 0  # shares the system prompt with slot 0's record only
    assert add(p[2], "c") == 1  # slot 0 busy, the other records empty: the lowest free slot
    drain(loop)  # b and c together
    system = common_prefix(p[0], p[1], len(p[1]))
    assert answers["b"].result[2].prompt_tokens_reused == system > 10 and answers["c"].result[2].prompt_tokens_reused == 0
    assert add(p[2], "c2") == 1 and add(p[1], "b2") == 0  # back to the slots holding all of them
    assert add(p[3], "d") == 2  # slots 0 and 1 busy, 2 and 3 empty: the lower
    drain(loop)
    assert answers["c2"].result[2].prompt_tokens_reused == len(p[2]) - 1
    assert answers["b2"].result[2].prompt_tokens_reused == len(p[1]) - 1
    tie = ids_of(engine, "Open the gripper")
    shares = [common_prefix(runner.held[b], tie, len(tie)) for b in range(SLOTS)]
    assert shares[0] == shares[1] == shares[2] == system and shares[3] == 0
    assert add(tie, "tie") == 1  # equal records: the least recently taken (0 took b2 after 1 took c2)
    drain(loop)
    for key, ids in (("a", p[0]), ("b", p[1]), ("c", p[2]), ("c2", p[2]), ("b2", p[1]), ("d", p[3]), ("tie", tie)):
        assert answers[key].result[0] == cold_answer(cold, ids), key
    off = speculative.BatchLoop(runner, reuse=False)
    assert off.add(request(p[2])) == 0  # slot 1 holds p[2], but reuse is off
    drain(off)
    assert runner.held[0][:len(p[2])] == tuple(p[2])
    cold_run = run_together(runner, [request(p[2])])[0]  # reuse=False
    assert cold_run[2].prompt_tokens_reused == 0 and cold_run[0] == answers["c"].result[0]


def test_after_cancel_and_after_a_failure(engine, cold):
    """A cancelled request leaves its rows recorded (the next request on them reuses them and equals
    cold); an exception inside an iteration (here: the client's stream callback) empties every
    record, so the next requests run cold."""
    runner = engine.loop.runner
    loop = speculative.BatchLoop(runner, reuse=True)
    loop.clear()
    ids = ids_of(engine, TURNS[0])
    cut = request(ids, 40, sink=Kept(cancel=lambda: "cancelled" if loop.iterations > 5 else None))
    slot = loop.add(cut)
    drain(loop)
    assert len(runner.held[slot]) > len(ids)  # prompt + the tokens fed before the cancel
    after = run_together(runner, [request(ids)], reuse=True)[0]
    assert after[2].prompt_tokens_reused == len(ids) - 1 and after[0] == cold_answer(cold, ids)

    def fail(tokens):
        raise RuntimeError("the client went away")

    loop.add(request(ids_of(engine, TURNS[1]), sink=Kept(emit=fail)))
    loop.add(request(ids))
    with pytest.raises(RuntimeError, match="went away"):
        drain(loop)
    assert runner.held == [()] * SLOTS
    loop.clear()
    again = run_together(runner, [request(ids)], reuse=True)[0]
    assert again[2].prompt_tokens_reused == 0 and again[0] == cold_answer(cold, ids)


def test_warm_fills_every_slot_and_requests_reuse_it(engine, cold):
    """Engine.warm: every slot holds the system prompt's chat prefix (the same bytes in every
    region); requests through the engine, alone and four at once, reuse it and answer as cold ones."""
    n = warm(engine, SYSTEM)
    runner = engine.loop.runner
    prefix = tuple(ids_of(engine, TURNS[0])[:n])
    assert n > 10 and runner.held == [prefix] * SLOTS
    assert all((runner.k_cache[:, b, :, :n] == runner.k_cache[:, 0, :, :n]).all() for b in range(SLOTS))
    first = run_one(engine, GenerateRequest(prompt=TURNS[0], system_prompt=SYSTEM, max_new_tokens=16, k=K))
    assert first.stats.prompt_tokens_reused == n
    assert first.token_ids == cold_answer(cold, ids_of(engine, TURNS[0]), eos_ids=engine.eos_ids)
    warm(engine, SYSTEM)
    results = serve_together(engine, [GenerateRequest(prompt=turn, system_prompt=SYSTEM, max_new_tokens=16, k=K)
                                      for turn in TURNS])
    for result, turn in zip(results, TURNS):
        assert result.stats.prompt_tokens_reused == n
        assert result.token_ids == cold_answer(cold, ids_of(engine, turn), eos_ids=engine.eos_ids)

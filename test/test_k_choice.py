"""speculative.k: auto (runtime/k_choice.py): each request's k (0 included) per iteration from its live
acceptance and the measured call costs. A drafter that is always wrong settles at k = 0 within 8 iterations
and costs at most 5 % over plain decoding; one that is always right drafts the largest k; one that starts
matching again is used again (the probe); and the output is target-only's (greedy: token for token,
sampling: the same distribution) whatever k runs."""
from __future__ import annotations

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.config import AUTO_K, ConfigError, from_params
from spec_edge.runtime import k_choice
from spec_edge import artifacts
from spec_edge.runtime.k_choice import CallCosts, KChoice
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.speculative import BatchLoop, SlotRequest
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated
from test_speculation_load import drafted_fields
from tiny import Kept, chi2_critical, chi2_statistic, exact_first

# q4 on this CPU (docs/bench.md): the step is a width-2 call, verify(4) = 1.26 steps, verify(5) = 1.40
Q4 = CallCosts({(1, 2): 10.0, (1, 3): 11.0, (1, 4): 12.6, (1, 5): 14.0})
FP32 = CallCosts({(1, 1): 14.0, (1, 2): 15.5, (1, 4): 18.0, (1, 5): 20.0})


def settle(choice: KChoice, costs: CallCosts, step_width: int, accepted, iterations: int = 40) -> list[int]:
    """The k chosen at each iteration when a verify of d drafts accepts accepted(d) of them."""
    ks = []
    for _ in range(iterations):
        k = choice.choose(max(choice.ks), costs, 1, step_width)
        ks.append(k)
        if k:
            choice.drafted(k, 0.01 * k)
            choice.observe(k, accepted(k))
    return ks


@pytest.mark.parametrize("costs,step_width", [(Q4, 2), (FP32, 1)])
def test_always_wrong_settles_at_plain_and_probes_rarely(costs, step_width):
    choice = KChoice((2, 3, 4))
    ks = settle(choice, costs, step_width, lambda d: 0, iterations=200)
    first_off = ks.index(0)
    assert first_off < 8 and ks[0] == 4  # starts at the largest k, plain within 8 iterations
    probes = [i for i in range(first_off, len(ks)) if ks[i]]
    assert all(ks[i] == 2 for i in probes)  # a probe drafts the smallest k
    budget = choice.gap(2, costs, 1, step_width)  # the probe's extra cost over a step, 2 % per iteration
    assert k_choice.PROBE_GAP < budget <= k_choice.PROBE_GAP_MAX and choice.failed == min(len(probes), 16)
    gaps = np.diff([first_off - 1] + probes).tolist()  # the first probe PROBE_GAP plain steps after the stop
    assert gaps[0] == k_choice.PROBE_GAP and gaps[-1] == budget and gaps == sorted(gaps)
    assert len(probes) <= 200 // budget + 2


def test_probes_back_off_and_a_drafter_that_matches_again_is_used_again():
    """The first probe after a stop comes once it costs at most PROBE_SHARE of the plain steps before it,
    and each probe that fails doubles the gap up to the budget gap (the probe's measured cost, catch-up
    included, over PROBE_BUDGET): a costly hopeless drafter is tried rarely (4 probes in 400 iterations, not
    the 100 a fixed gap of PROBE_GAP would make); once it matches again the next probe (at most the budget
    gap away) starts the back-off over, and the probe after it restarts speculation."""
    choice, ks = KChoice((2, 4)), []
    for i in range(600):
        right = i >= 400
        k = choice.choose(4, Q4, 1, 2)
        ks.append(k)
        if k:  # a probe's proposal catches up on the plain steps' tokens: 30 ms, 3 steps; drafting 2 ms a token
            choice.drafted(k, 30.0 if choice.probing else 2.0 * k)
            choice.observe(k, k if right else 0)
    wrong = [i for i in range(400) if ks[i]]  # the first iteration ran at the prior's k, then the probes
    extra = (Q4.cost(1, 3, 2) + 30.0 - 10.0) / 10.0  # a probe's extra cost over a step: 3.1 steps
    first = int(extra / k_choice.PROBE_SHARE) + 1  # 25: each probe costs at most PROBE_SHARE of the steps before it
    assert extra / k_choice.PROBE_BUDGET > k_choice.PROBE_GAP_MAX  # the budget gap is the cap here
    gaps = np.diff(wrong).tolist()  # the first probe priced by drafting alone (no probe timed yet): sooner
    assert gaps[0] < first and gaps[1:] == [2 * first, 4 * first, 128], wrong
    back = next(i for i in range(400, 600) if ks[i])  # the first probe once it matches: at most the gap away
    assert back - 400 <= k_choice.PROBE_GAP_MAX and choice.failed == 0
    again = next(i for i in range(back + 1, 600) if ks[i])
    assert again - back <= first and ks[again] == 2  # the next probe soon after (the back-off started over)
    assert 0 not in ks[again:] and set(ks[-40:]) == {4}  # used again, up to the largest k


def test_a_drafter_that_pays_in_the_long_run_is_not_stopped_by_a_bad_streak():
    """Draft 1 accepted 40 % of the time, the next ones 60 % (i.i.d., seeded): k = 3 makes 1.3x plain on
    these costs. A few rejections in a row pull this stretch's estimate under plain's rate, but the
    drafter's long-run estimate still says it pays, so speculation goes on (with this stretch's estimate
    alone it ran 14 % of the iterations and made 1.04x)."""
    import random
    rng, choice, tokens, ms = random.Random(1), KChoice((3, 4)), 0, 0.0
    for _ in range(2000):
        k = choice.choose(4, Q4, 1, 2)
        if not k:
            tokens, ms = tokens + 1, ms + Q4.cost(1, 2, 2)
            continue
        choice.drafted(k, 0.3 * k)
        accepted = 0
        while accepted < k and rng.random() < (0.4 if accepted == 0 else 0.6):
            accepted += 1
        choice.observe(k, accepted)
        tokens, ms = tokens + accepted + 1, ms + Q4.cost(1, k + 1, 2) + 0.3 * k
    assert tokens / ms * Q4.cost(1, 2, 2) > 1.25 and choice.probes <= 16
    assert choice.mean[0] == pytest.approx(0.4, abs=0.15)


def test_drafts_that_stop_short_do_not_inflate_the_positions_past_them():
    """An n-gram drafter whose matches run out after 2 tokens, all accepted, when k = 4 was asked: a verify
    emits 3 tokens at k = 3 and 4 alike, so position 3 counts as not accepted and k = 3, the cheaper call,
    runs (taking the short window as full made the positions past it follow its last: k = 4 was kept)."""
    choice = KChoice((3, 4))
    for _ in range(12):
        k = choice.choose(4, Q4, 1, 2)
        choice.drafted(k, 0.01)
        choice.observe(2, 2, k)
    assert choice.accept[2] < 0.05 and choice.expected_tokens(4) == pytest.approx(3.0, abs=0.1)
    assert choice.k == 3


def test_the_long_run_does_not_keep_a_drafter_going_through_a_losing_text():
    """Right for 300 iterations (its long run pays), then always wrong: this stretch's estimate says stop
    within a few verifies and the long run may keep speculation going DOUBT verifies more, not until the long
    run itself comes down (~40 verifies here); probes that match nothing do not restart it."""
    choice = KChoice((3, 4))
    settle(choice, Q4, 2, lambda d: d, iterations=300)
    ks = settle(choice, Q4, 2, lambda d: 0, iterations=80)
    stop = ks.index(0)  # this stretch's estimate needs 8 rejections to fall from 1 under plain's rate
    assert stop <= 8 + k_choice.DOUBT, ks
    assert all(ks[i] == 0 for i in range(stop, len(ks) - 1) if ks[i + 1]), ks  # then probes only: none matched


def test_a_lucky_verify_does_not_start_the_count_over():
    """Right for 300 iterations, then a losing text with one verify in 8 accepting 2 drafts (1.25 tokens per
    verify of 1.26 steps): each lucky verify lifts this stretch's estimate over plain's rate for a verify or
    two. The verifies that say stop are counted net of those that say go on, so speculation stops within
    ~70 iterations (counted in a row, the count started over at every lucky verify and the drafter ran until
    its long-run estimate came down, 143 iterations)."""
    choice = KChoice((3, 4))
    settle(choice, Q4, 2, lambda d: d, iterations=300)
    outcomes = iter([2 if i % 8 == 7 else 0 for i in range(200)])
    ks = settle(choice, Q4, 2, lambda d: next(outcomes), iterations=200)
    assert 0 in ks[:80], ks


def test_the_cheaper_k_runs_when_the_larger_adds_nothing():
    """Costs as measured on q4 (verify(5) 7.7 % over verify(4)), a draft of 1-2 accepted tokens whatever k:
    k = 4 adds no token, so k = 3 runs from its first verify on (switching k > 0 costs nothing; a hysteresis
    of 8 % between them kept k = 4 for k = 3's tokens)."""
    costs, choice = CallCosts({(1, 2): 5.2, (1, 4): 6.5, (1, 5): 7.0}), KChoice((3, 4))
    outcomes = iter([2 if i % 2 else 1 for i in range(60)])
    ks = settle(choice, costs, 2, lambda d: min(d, next(outcomes)), iterations=60)
    assert ks[0] == 4 and set(ks[1:]) == {3}, ks


@pytest.mark.parametrize("costs,step_width", [(Q4, 2), (FP32, 1)])
def test_always_right_drafts_the_largest_k(costs, step_width):
    assert set(settle(KChoice((1, 2, 3, 4)), costs, step_width, lambda d: d)) == {4}


def test_a_drafter_that_matches_again_is_used_again():
    choice = KChoice((2, 4))
    wrong = settle(choice, Q4, 2, lambda d: 0, iterations=30)
    assert choice.k == 0 and wrong.count(0) > 15
    right = settle(choice, Q4, 2, lambda d: d, iterations=40)
    assert right[-1] == 4 and right.index(4) <= 20  # the next probe matches: speculation again, up to k=4
    assert choice.probes >= 1 and "k=4 expected fastest" in choice.why


def test_costly_drafting_and_rare_acceptance_choose_plain():
    # a drafter as costly as a target step per draft (layer-skip-like) does not pay even when always right
    choice = KChoice((1, 2, 3, 4))
    for _ in range(10):
        k = choice.choose(4, FP32, 1, 1)
        if k:
            choice.drafted(k, 14.0 * k)
            choice.observe(k, k)
    assert choice.k == 0
    # the load policy's cap bounds the choice; cap 0 is never asked (the loop steps)
    assert KChoice((2, 4)).choose(2, Q4, 1, 2) == 2


def test_costs_observed_and_filled_in():
    costs = CallCosts({(1, 1): 10.0, (1, 5): 14.0, (1, 2): 9.0})
    assert costs.cost(1, 4, 1) == pytest.approx(12.0, abs=0.6)  # a line through the measured widths
    assert costs.cost(1, 2, 1) == 10.0  # never below the step (a timing below it is noise)
    assert costs.cost(2, 3, 1) is None  # the step at 2 rows was never timed
    costs.observe(2, 1, 15.0)
    assert costs.cost(2, 5, 1) == 15.0  # an untimed width is tried at the step's cost
    costs.observe(1, 1, 20.0)  # the machine got slower: every width at 1 row (and the step a little more)
    assert costs.level[1] == pytest.approx(1.1) and costs.cost(1, 5, 1) == pytest.approx(15.4)
    assert costs.cost(1, 1, 1) == pytest.approx(1.1 * (10.0 + k_choice.RATIO * (20.0 / 1.1 - 10.0)))
    costs.observe(1, 5, 14.0 * 1.1 * 100)  # a descheduled call counts as 3x the level at most
    assert costs.level[1] == pytest.approx(1.1 + k_choice.FRESH * 2 * 1.1)


def test_ratios_measured_on_a_busy_machine_are_corrected_by_live_calls():
    """Loaded while another process held the cores, an engine measured a verify at 1.05 steps (14.4 /
    15.1 ms); the calls it makes (6.0 / 7.6 ms, 1.27 steps) correct the ratio within a few hundred calls:
    with the load-time ratio alone, k auto took verify as nearly free and speculated through losing texts."""
    costs = CallCosts({(1, 2): 14.4, (1, 5): 15.1})
    for i in range(300):
        costs.observe(1, 2, 6.0) if i % 2 else costs.observe(1, 5, 7.6)
    assert costs.cost(1, 5, 2) / costs.cost(1, 2, 2) == pytest.approx(7.6 / 6.0, abs=0.03)
    assert costs.cost(1, 2, 2) == pytest.approx(6.0, rel=0.1)


def test_config():
    assert from_params({}).speculative.k == AUTO_K
    assert from_params({"speculative.k": "4"}).speculative.k == 4  # a ROS string parameter
    with pytest.raises(ConfigError, match="speculative.k must be auto or an integer"):
        from_params({"speculative.k": "fast"})
    with pytest.raises(ConfigError, match="Edge-LLM drafts a fixed chain per engine"):
        from_params({"runtime.backend": "tensorrt", "graphs.dtype": "float16", "graphs.weights": "fp32",
                     "graphs.batch_slots": 1, "speculative.drafter": "eagle3", "speculative.eagle3_head": "h"})


# ---------------------------------------------------------------------------------------------
# The loop on the tiny model's real graphs


class Oracle:
    """Knows target-only's greedy continuation: proposes it (right) or each token + 1 (always wrong)."""

    def __init__(self, prompt_len: int, continuation: list[int], vocab: int, right: bool):
        self.name, self.prompt_len, self.cont, self.vocab, self.right = "oracle", prompt_len, continuation, vocab, right

    def propose(self, seq, k, sampler):
        done = len(seq) - self.prompt_len  # the pending token is cont[done - 1]
        tokens = self.cont[done:done + k]
        if not tokens:
            return None
        return Draft(tokens=tokens if self.right else [(t + 1) % self.vocab for t in tokens], q_draft=None)

    def check_k(self, k): ...

    def forget(self): ...

    def start(self, prompt_ids): ...

    def observe(self, n_proposed, n_accepted): ...

    def finish(self): ...


@pytest.fixture(scope="module")
def loop(tiny_engine):
    """A loop over the tiny target with the call costs measured as an auto engine measures them at load."""
    return BatchLoop(tiny_engine.runner, costs=k_choice.measure_costs(tiny_engine.runner))


def decode(loop, request: SlotRequest) -> tuple[list[int], object, list[int]]:
    """(token ids, stats, the k of each decode iteration) of request alone in loop."""
    ks, request.sink = [], Kept()
    index = loop.add(request)
    while loop.occupied:
        slot = loop.slots[index]
        loop.iterate()
        if slot.pos:  # it decoded (the iteration its prompt went in included)
            ks.append(slot.k_now)
    return request.sink.result[0], request.sink.result[2], ks


def call_ms(loop, stats, step_width: int) -> float:
    """The target time of a run's decode calls as the measured call costs price them (a count, not wall time)."""
    return (stats.step_calls * loop.costs.cost(1, step_width, step_width)
            + sum(n * loop.costs.cost(1, k + 1, step_width) for k, n in enumerate(stats.verify_calls_by_k, 1)))


def oracle_run(loop, ids: list[int], max_new: int, right: bool):
    """(target-only's greedy ids, auto's ids, stats, the k of each decode iteration) of ids with an oracle
    drafter, both to max_new tokens (no EOS)."""
    want = decode(loop, SlotRequest(prompt_ids=ids, max_new_tokens=max_new, eos_ids=()))[0]
    ks = sorted(w - 1 for w in loop.verify_widths)
    got, stats, per_iteration = decode(loop, SlotRequest(
        prompt_ids=ids, max_new_tokens=max_new, eos_ids=(), k=max(ks), k_choice=KChoice(tuple(ks)),
        drafter=Oracle(len(ids), want, loop.runner.vocab_size, right)))
    return want, got, stats, per_iteration


@pytest.mark.parametrize("right", [False, True])
def test_oracle_drafters_in_the_loop(tiny_engine, loop, right):
    """Exact either way; which k runs follows the tiny model's call costs (~0.1 ms, timed here: noisy under
    load), so the settling and the speed are asserted on the real model (test_k_choice_real.py)."""
    want, got, stats, per_iteration = oracle_run(loop, tiny_engine.tokenizer.encode("Move the arm"), 100, right)
    assert got == want and len(got) == 100
    assert stats.accepted == (stats.drafted if right else 0)
    assert_speculated(stats, accepted=right, what=f"right={right}")
    assert stats.auto_off_steps == per_iteration.count(0)
    if right:
        assert stats.auto_off_steps == 0


@pytest.fixture(scope="module")
def auto_engine(tiny_cfg):
    return artifacts.engine(tiny_cfg.replace(**{"speculative.k": AUTO_K}), progress=lambda message: None)


def test_engine_measures_costs_and_auto_is_exact(auto_engine, tiny_engine):
    widths = set(auto_engine.runner.widths)
    assert {w for (rows, w) in auto_engine.loop.costs.ms} == widths  # measured at load, every width
    assert "k_choice" in auto_engine.info()
    for drafter in ("ngram", "layerskip"):  # (auto turns the random draft model off: plain decoding, no case)
        for prompt in ("Move the arm to the left, the arm to the left, the arm to the left", "def add(a, b):"):
            # prompt lookup drafts the repeats of a favoured token; layer skip's own drafts are accepted as they are
            fields = ({**drafted_fields(tiny_engine, prompt), "max_new_tokens": 40} if drafter == "ngram"
                      else {"prompt": prompt, "max_new_tokens": 40})
            plain_result = run_one(tiny_engine, GenerateRequest(**fields, speculate=False))
            auto_engine._k_last.pop(drafter, None)  # each case starts at the largest k, not where the last one left
            result = run_one(auto_engine, GenerateRequest(**fields, drafter=drafter))
            assert result.token_ids == plain_result.token_ids, (drafter, prompt)
            assert result.stats.k == max(w - 1 for w in widths if w > 1)
            # layer skip's first drafts here are rejected and auto goes plain after its probes: verified, not accepted
            assert_speculated(result.stats, accepted=drafter == "ngram", what=f"{drafter} {prompt[:12]!r}")
            if result.stats.auto_off_steps:
                assert "speculative.k auto" in result.speculation_off_reason
    fixed = run_one(auto_engine, GenerateRequest(prompt="def add(a, b):", max_new_tokens=20, drafter="draft", k=3))
    assert fixed.stats.k == 3 and fixed.stats.auto_off_steps == 0  # a request's own k is fixed


def test_sampling_under_auto_keeps_the_target_distribution(tiny_engine, loop):
    """The first three sampled tokens under auto (a plain step and a probe, or speculation going on, as the
    outcomes go) follow the target's exact distribution (chi-square, as tiny.assert_sampling_follows_target)."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt_ids, exact = exact_first(tiny_engine, params, 3)
    drafter = tiny_engine.drafter("draft")
    costs = CallCosts({(1, 1): 10.0, (1, 2): 10.5, (1, 4): 16.0})  # k = 1 pays only when a_1 > ~0.13
    counts: dict = {}
    used = {"plain": 0, "verify": 0}
    runs = []
    n = 1200
    for seed in range(n):
        test_loop = BatchLoop(tiny_engine.runner, costs=CallCosts(dict(costs.ms)))
        choice = KChoice((1, 3), accept=[0.1, 0.9, 0.9])
        choice.k, choice.since_probe, choice.verifies = 0, k_choice.PROBE_GAP - 1, 1  # at plain, a probe due
        ids, stats, _ = decode(test_loop, SlotRequest(prompt_ids=prompt_ids, max_new_tokens=3, eos_ids=(),
                                                      sampling=params, seed=seed, drafter=drafter, k=3,
                                                      k_choice=choice))
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        used["plain"] += stats.auto_off_steps
        used["verify"] += stats.verify_calls
        runs.append(stats)
    assert all(used.values()), used  # every kind of iteration ran
    # one case (the seeds sample one distribution): the probes verified; the random draft model's k = 1 drafts are
    # rejected, the point here is the switch between plain steps and probes
    assert_speculated(*runs, accepted=False, what="the probes")
    stat, df = chi2_statistic(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)


def test_q4_never_verifies_with_its_two_row_step(tiny_cfg, tiny_engine, tmp_path_factory):
    """q4 without a k = 1 graph: width 2 is the step, which feeds its one token twice (graphs/two_rows.py).
    A one-token draft (k = 1, a short proposal, a probe) is verified in the next verify width, so the
    output stays target-only's (it took the draft as fed before: wrong tokens)."""
    from spec_edge.artifacts import ensure_packed
    from spec_edge.graphs import ort_attention, plan, quantize
    from spec_edge.runtime.backends.ort_runner import b1_runner
    from test_quantize import _fresh_blocks

    cfg = tiny_cfg.replace(**{"graphs.k_values": [3], "speculative.k": 3})
    graphs = plan.graph_plan(cfg, "target")
    fused = ort_attention.ensure_fused(tiny_engine.graph_dir, lambda m: None, graphs=graphs)
    folder = quantize.convert_folder(fused, tmp_path_factory.mktemp("q4k3") / "q4", _fresh_blocks,
                                     accuracy_level=plan.ACCURACY_LEVELS["q4"], stamp="tiny",
                                     source="tiny blocks", progress=lambda m: None, graphs=graphs)
    ensure_packed(folder, progress=lambda m: None)
    runner = b1_runner(folder).runner  # the slotted runner of one slot
    loop = BatchLoop(runner)
    assert runner.step_width == 2 and runner.widths == {2, 4} and loop.verify_widths == {4}
    ids = tiny_engine.tokenizer.encode("Move the arm")
    want = decode(loop, SlotRequest(prompt_ids=ids, max_new_tokens=30, eos_ids=()))[0]
    got, stats, _ = decode(loop, SlotRequest(prompt_ids=ids, max_new_tokens=30, eos_ids=(), k=1,
                                             drafter=Oracle(len(ids), want, runner.vocab_size, True)))
    assert got == want and stats.accepted == stats.drafted == stats.verify_calls
    assert_speculated(stats)


def test_the_next_request_starts_where_the_last_left():
    wrong = KChoice((2, 4))
    settle(wrong, Q4, 2, lambda d: 0, iterations=20)
    following = KChoice.after(wrong, (2, 4))
    ks = [following.choose(4, Q4, 1, 2)]
    while not following.probing:
        ks.append(following.choose(4, Q4, 1, 2))
    assert set(ks) == {0, 2} and len(ks) <= following.gap(2, Q4, 1, 2)  # plain, probing on the last schedule
    following.silent()  # the probe drafted nothing: probe again
    assert following.choose(4, Q4, 1, 2) == 2 and following.probes == 1  # a probe that drafted is counted once
    right = KChoice((2, 4))
    settle(right, Q4, 2, lambda d: d, iterations=10)
    assert KChoice.after(right, (2, 4)).choose(4, Q4, 1, 2) == 4 and KChoice.after(None, (2, 4)).k == 4
    right.accept, right.k, right.since_probe = [0.0] * 4, 0, 0  # its last request ended on a bad stretch, at plain
    following = KChoice.after(right, (2, 4))
    assert following.choose(4, Q4, 1, 2) == 2 and following.probing  # a new text, the long run pays: probe at once
    following.observe(2, 2, 2)
    assert following.choose(4, Q4, 1, 2) == 4  # and the probe restarts it


def test_auto_at_plain_keeps_the_grammar_forced_drafts(tiny_engine, loop):
    """A drafter auto has turned off (k = 0) never turns off the grammar's forced tokens: they need no drafter
    and are all accepted; the output stays the constrained target-only one."""
    from spec_edge.runtime.requests import GenerateRequest as Request
    schema = r"(pick|place|move) the (red|blue|green) (box|cup|arm)( slowly| fast)?\."
    prompt_ids = front_of(tiny_engine).prompt_ids(Request(prompt="Move the arm"))

    def run(k, choice):
        return decode(loop, SlotRequest(prompt_ids=prompt_ids, max_new_tokens=24, eos_ids=tiny_engine.eos_ids,
                                        drafter=tiny_engine.drafter("draft") if k else None, k=k, k_choice=choice,
                                        constraint=tiny_engine.grammars.constraint("regex", schema),
                                        forced_drafts=True))

    plain_ids, _, _ = run(0, None)
    choice = KChoice((1, 3), accept=[0.0, 0.0, 0.0])
    choice.k, choice.since_probe, choice.verifies = 0, -10 ** 6, 1  # settled at plain, no probe due
    ids, stats, ks = run(3, choice)
    assert ids == plain_ids and choice.k == 0 and choice.probes == 0
    assert stats.forced > 0 and stats.verify_calls > 0 and stats.accepted >= stats.forced, stats
    assert stats.drafted == stats.forced  # the drafter itself never ran

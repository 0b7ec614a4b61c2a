"""The mutation check: every named mutation of the exactness and sampling rules (test/mutations.py) must
make at least one of a fixed set of fast tests fail; a mutation that survives fails here by name.

Per mutation, the tests below run in this process, in this order (fast unit tests first, the loop-level
chi-square tests last), with the mutated function installed, until one fails; the first that fails is the
mutation's catcher (docs/testing.md lists them). Any exception (pytest.fail's included) counts as failing, as
it would in pytest.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import test_guided
import test_request_fields
import test_sampling
import test_speculative
from mutations import MUTATIONS, applied, mutated_function

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def fast_tests(engine, self_runner) -> list[tuple[str, object]]:
    """(pytest id, a call running that test) of the fixed set, in the order they are tried."""
    def greedy(name, k):
        return (f"test_speculative.py::test_greedy_speculative_equals_plain[{name}-{k}]",
                lambda: test_speculative.test_greedy_speculative_equals_plain(engine, self_runner, name, k))

    def guided(name, forced):
        return (f"test_guided.py::test_greedy_constrained_speculative_equals_constrained_plain"
                f"[{name}-{'forced' if forced else 'drafted'}]",
                lambda: test_guided.test_greedy_constrained_speculative_equals_constrained_plain(
                    engine, self_runner, name, forced))

    def loop(name):
        return (f"test_sampling.py::test_generated_tokens_follow_target_distribution[{name}]",
                lambda: test_sampling.test_generated_tokens_follow_target_distribution(engine, name))

    return [
        *[(f"test_sampling.py::{f.__name__}", f) for f in (
            test_sampling.test_acceptance_rule_preserves_p_target, test_sampling.test_one_hot_draft_preserves_p_target,
            test_sampling.test_every_draft_accepted_draws_the_bonus_from_row_k,
            test_sampling.test_top_p_and_top_k_restrict_support, test_sampling.test_temperature_divides_the_logits)],
        *[(f"test_request_fields.py::{f.__name__}", f) for f in (
            test_request_fields.test_each_row_sees_its_own_history,
            test_request_fields.test_min_p_keeps_ids_near_the_top)],
        greedy("self", 3), greedy("layerskip", 4), greedy("ngram", 4), greedy("draft", 3), greedy("wrong", 3),
        ("test_speculative.py::test_eos_inside_a_draft",
         lambda: test_speculative.test_eos_inside_a_draft(engine, self_runner)),
        ("test_request_fields.py::test_greedy_speculative_equals_target_only_with_each_option[penalties]",
         lambda: test_request_fields.test_greedy_speculative_equals_target_only_with_each_option(engine, "penalties")),
        ("test_guided.py::test_verify_masks_and_renormalises_the_draft_q",
         lambda: test_guided.test_verify_masks_and_renormalises_the_draft_q(engine)),
        guided("self", False), guided("ngram", False), guided("none", True),
        ("test_guided.py::test_eos_outputs_match_the_grammar", lambda: test_guided.test_eos_outputs_match_the_grammar(engine)),
        loop("self"), loop("tempered-self"), loop("greedy-self"), loop("draft"),
        ("test_sampling.py::test_processed_distribution_is_kept[greedy-self]",
         lambda: test_sampling.test_processed_distribution_is_kept(engine, "greedy-self")),
        ("test_guided.py::test_constrained_sampling_follows_the_constrained_target",
         lambda: test_guided.test_constrained_sampling_follows_the_constrained_target(engine)),
    ]


@pytest.fixture(scope="module")
def self_runner(tiny_engine):
    from spec_edge.runtime.backends.ort_runner import b1_runner

    return b1_runner(tiny_engine.graph_dir)


@pytest.mark.parametrize("mutation", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=f"known survivor: {m.survives}")) if m.survives else m
    for m in MUTATIONS], ids=[m.name for m in MUTATIONS])
def test_mutation_is_caught(mutation, tiny_engine, self_runner, record_property):
    started = time.perf_counter()
    with applied(mutation):
        for test_id, run in fast_tests(tiny_engine, self_runner):
            try:
                run()
            except pytest.skip.Exception:
                continue
            except (Exception, pytest.fail.Exception) as err:  # noqa: BLE001 (any failure of the test kills it)
                record_property("caught_by", test_id)
                print(f"\nmutation {mutation.name}: caught by {test_id} ({type(err).__name__}) "
                      f"in {time.perf_counter() - started:.1f} s")
                return
    pytest.fail(f"mutation {mutation.name} survived ({mutation.breaks}): no test of the fixed set failed with "
                f"{mutation.target} changed from {mutation.old!r} to {mutation.new!r}")


def test_every_mutation_applies_and_is_documented():
    """Each snippet is still in the product exactly once, and docs/testing.md's table names every mutation."""
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), re.MULTILINE))
    for mutation in MUTATIONS:
        original, mutant = mutated_function(mutation)
        assert mutant is not original
    assert documented == {m.name for m in MUTATIONS}
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)

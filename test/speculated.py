"""The one check every exactness and distribution test makes that it really speculated.

An exactness test (speculative output == target-only output) holds by construction when the drafter never
drafts: a loop without a verify call is target-only decoding. assert_speculated makes each such test prove
that verify calls ran and, where the accept path matters, that drafts were accepted (so the accepted
prefix, the correction and the bonus token were all exercised), summed over the runs the test made.
"""
from __future__ import annotations


def assert_speculated(*stats, accepted: bool = True, what: str = "") -> None:
    """stats: runtime.stats.Stats (or dicts of their fields) of the runs of one test. Fails unless they made
    verify calls, and (accepted=True) accepted at least one draft."""
    def get(s, name):
        return s[name] if isinstance(s, dict) else getattr(s, name)

    verify_calls = sum(get(s, "verify_calls") for s in stats)
    drafted = sum(get(s, "drafted") for s in stats)
    n_accepted = sum(get(s, "accepted") for s in stats)
    label = f"{what}: " if what else ""
    assert verify_calls > 0 and drafted > 0, (
        f"{label}no verify call in {len(stats)} run(s): the test held by construction (target-only decoding)")
    if accepted:
        assert n_accepted > 0, (f"{label}{drafted} drafts in {verify_calls} verify calls, none accepted: the accept "
                                f"path (accepted prefix, bonus token) was never exercised")

"""speculative.k: auto on the embedded default's real graphs (fp32, one slot, the call costs measured as the
engine loads): a drafter that is always wrong settles at k = 0 within 8 iterations and decodes at >= 0.95x
plain; one that is always right drafts the largest k. Speed is counted, not timed: calls priced by the
loop's own measured costs (a loaded CI machine moves wall time, not the calls a run makes)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.config import AUTO_K, Config
from spec_edge import artifacts
from spec_edge.runtime.requests import GenerateRequest
from test_k_choice import call_ms, oracle_run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real_model("default")


@pytest.fixture(scope="module")
def engine():
    cfg = Config().replace(**{"runtime.engine_dir": str(REPO / "engines"), "speculative.k": AUTO_K})
    return artifacts.engine(cfg, progress=lambda m: print(m, file=sys.stderr))


@pytest.mark.parametrize("right", [False, True])
def test_oracle_drafters(engine, right):
    loop = engine.loop  # its costs measured at load (Engine.from_config), every call fed back
    ids = front_of(engine).prompt_ids(GenerateRequest(prompt="Write a short story about a small robot that learns to paint."))
    want, got, stats, per_iteration = oracle_run(loop, ids, 96, right)
    assert got == want
    ks = sorted(w - 1 for w in engine.loop.verify_widths)
    if right:  # the largest k at every iteration (verify[k+1] costs ~1.4 steps here: k+1 tokens for it)
        assert set(per_iteration[:-2]) == {max(ks)}, (per_iteration, loop.costs.ms)
        return
    first_off = per_iteration.index(0)
    assert first_off <= 8 and all(k in (0, min(ks)) for k in per_iteration[first_off:]), per_iteration
    step = loop.costs.cost(1, loop.step_width, loop.step_width)
    assert (len(want) - 1) * step / call_ms(loop, stats, loop.step_width) >= 0.95, (per_iteration, loop.costs.ms)

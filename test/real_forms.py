"""The embedded default's graph forms the real-model tests run (docs/testing.md, "Tiers")."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# By name (pytest.mark.real_model names them): each made once per session by conftest.py's real_forms fixture,
# in <repo>/engines, before the first test runs. Values are overrides of Config() (spec_edge/config.py's
# defaults), applied with runtime.engine_dir <repo>/engines.
REAL_FORMS = {
    # fp32 with one slot: test/ros/rosutil.test_params (every ROS node test), the in-process real-model tests
    "fp32": {"graphs.weights": "fp32", "graphs.batch_slots": 1},
    # fp32 with two slots: test_prefix_reuse_real's batched engine (the m = 2 graphs beside the fp32 ones)
    "fp32-b2": {"graphs.weights": "fp32", "graphs.batch_slots": 2},
    # the default profile (q4, 4 slots): config/default.yaml, `spec-edge generate` with no options
    "default": {},
    # the committed EAGLE-3 head on the default (its own target form: the full-model graphs return hidden states)
    "eagle3": {"speculative.eagle3_head": str(REPO / "heads" / "smollm2-135m-eagle3"), "speculative.drafter": "eagle3"},
}

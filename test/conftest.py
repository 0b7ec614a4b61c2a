"""Shared fixtures: tiny random-weight models exported once per test session; the real model's forms made once per
session (real_forms); the release tier (--release). docs/testing.md, "Tiers"."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

from real_forms import REAL_FORMS, REPO  # noqa: E402
from tiny import TINY_K_VALUES  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tiny import make_checkpoint, train_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer()
    target = make_checkpoint(root / "target", seed=1, tokenizer=tok)
    draft = make_checkpoint(root / "draft", seed=2, n_layers=2, tie=True, tokenizer=tok)
    return {"target": target, "draft": draft, "root": root}


@pytest.fixture(scope="session")
def tiny_cfg(tiny_models):
    from spec_edge.config import Config

    # fp32, one slot: a Hugging Face folder has no GGUF blocks for the default q4, and one slot is the
    # single-request path the tests compare against (test_batch*.py set graphs.batch_slots themselves)
    return Config().replace(**{
        "model.target": str(tiny_models["target"]), "model.draft": str(tiny_models["draft"]),
        "graphs.weights": "fp32", "graphs.batch_slots": 1,
        "graphs.max_context": 128, "graphs.prefill_chunk": 16, "graphs.k_values": TINY_K_VALUES,
        "graphs.layer_skip_layers": 2, "runtime.engine_dir": str(tiny_models["root"] / "engines"),
        "runtime.profile": "tiny", "speculative.drafter": "draft", "speculative.k": 4})


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """A tiny random-weight Idefics3 (SmolVLM-family) Hugging Face folder (test/tiny_vlm.py)."""
    from tiny_vlm import make_vlm

    return make_vlm(tmp_path_factory.mktemp("tiny_vlm") / "vlm")


@pytest.fixture(scope="session")
def tiny_vlm_cfg(tiny_vlm, tmp_path_factory):
    """A Config serving the tiny vision model (images: model.max_images), fp32, one slot, k 3, n-gram drafter."""
    from spec_edge.config import Config

    return Config().replace(**{
        "model.target": str(tiny_vlm), "graphs.weights": "fp32", "graphs.batch_slots": 1,
        "graphs.max_context": 128, "graphs.prefill_chunk": 16, "graphs.k_values": [3],
        "graphs.layer_skip_layers": 2, "runtime.engine_dir": str(tmp_path_factory.mktemp("vlm_engines")),
        "runtime.profile": "tiny-vlm", "speculative.drafter": "ngram", "speculative.k": 3})


@pytest.fixture(scope="session")
def tiny_engine(tiny_cfg):
    from spec_edge import artifacts

    return artifacts.engine(tiny_cfg, progress=lambda message: None)


# ---- tiers and the real model's forms (docs/testing.md, "Tiers") ----

_MAKE_FORMS = """
import json, sys, time
from spec_edge import artifacts
from spec_edge.config import Config
for name, overrides in json.loads(sys.argv[1]).items():
    started = time.monotonic()
    artifacts.ensure(Config().replace(**overrides), progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({"form": name, "s": round(time.monotonic() - started, 1)}), flush=True)
"""


def pytest_addoption(parser):
    parser.addoption("--release", action="store_true",
                     help="also run the release tier (tests marked release: docs/testing.md, 'Tiers')")


def pytest_configure(config):
    config.addinivalue_line("markers", "release: the release tier, run before a release with --release, deselected "
                                       "otherwise (and in CI): docs/testing.md, 'Tiers'")
    config.addinivalue_line("markers", "real_model(*forms): the test runs the embedded default's graphs in these "
                                       "forms (test/real_forms.py REAL_FORMS), made once per session by the real_forms fixture")


def pytest_collection_modifyitems(config, items):
    unknown = {form for item in items for mark in item.iter_markers("real_model") for form in mark.args
               if form not in REAL_FORMS}
    if unknown:
        raise pytest.UsageError(f"real_model marks name unknown forms {sorted(unknown)}; known: {sorted(REAL_FORMS)}")
    if config.getoption("--release") or "release" in (config.option.markexpr or ""):
        return  # asked for: --release, or -m naming the tier (-m release: the release tier alone)
    release = [item for item in items if item.get_closest_marker("release")]
    if release:
        config.hook.pytest_deselected(items=release)
        items[:] = [item for item in items if not item.get_closest_marker("release")]
        config._spec_edge_release_deselected = len(release)


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_spec_edge_release_deselected", 0)
    if n:
        terminalreporter.write_line(f"release tier: {n} tests deselected (run them with --release: docs/testing.md)")


@pytest.fixture(scope="session", autouse=True)
def real_forms(request):
    """Every form of the real model the session's tests mark (real_model), made before the first test runs, in
    one process of its own (torch's export heap stays out of the test process): a test's time is its own, not
    the export of whichever test came first. A form already complete costs a check. Tests that will be skipped
    (rclpy missing) ask for nothing."""
    import json
    import subprocess
    import time

    wanted: list[str] = []
    for item in request.session.items:
        if item.get_closest_marker("skip"):
            continue
        for mark in item.iter_markers("real_model"):
            wanted += [form for form in mark.args if form not in wanted]
    if not wanted:
        return {}
    forms = {name: {"runtime.engine_dir": str(REPO / "engines"), **REAL_FORMS[name]} for name in wanted}
    started = time.monotonic()
    made = subprocess.run([sys.executable, "-c", _MAKE_FORMS, json.dumps(forms)], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)))
    if made.returncode != 0:
        pytest.exit(f"making the real model's forms {wanted} failed ({made.returncode}):\n{made.stderr[-4000:]}",
                    returncode=1)
    lines = [line for line in made.stdout.splitlines() if line.startswith('{"form"')]
    took = {entry["form"]: entry["s"] for entry in map(json.loads, lines)}
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # in the run's log, not in the first test's captured output
            reporter.write_line(f"\n[real_forms] {', '.join(f'{k} {v:.0f} s' for k, v in took.items())} "
                                f"(total {time.monotonic() - started:.0f} s, <repo>/engines)")
    return forms


@pytest.fixture(scope="module")
def remote(tiny_cfg, tiny_engine, tmp_path_factory):
    """A `spec-edge http` process on loopback serving the tiny profile (test/remote_server.py), for a remote decoder."""
    from remote_server import Server

    server = Server(tiny_cfg, tmp_path_factory.mktemp("remote"))
    server.start()
    yield server
    server.stop()

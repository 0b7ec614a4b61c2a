"""Engine folders that never break (tiny models): one form per folder, so switching between profiles
reloads and never re-exports; a loader runs only its own form's graphs; two processes making the same
folder at once both end with it whole; a writer killed with -9 leaves a folder the next command uses;
`spec-edge engines` lists the folders and --prune removes only those no profile uses."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from spec_edge.config import Config
from spec_edge.graphs import plan
from spec_edge import artifacts
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.onnxruntime import packed_dir
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated

REPO = Path(__file__).resolve().parents[1]
MAKING = ("[export]", "[fused]", "[q4]", "[q8]", "[packed]")  # what a run that makes graphs says
PROMPT = "Move the arm to the left"


def tiny_profile(tiny_models, engines: Path, **extra) -> Config:
    """A small plan of the session's tiny target (one k, short context), exported into `engines`."""
    settings = {"model.target": str(tiny_models["target"]), "graphs.weights": "fp32", "graphs.batch_slots": 1,
                "graphs.max_context": 64, "graphs.prefill_chunk": 8,
                "graphs.k_values": [3], "graphs.layer_skip_layers": 1, "runtime.engine_dir": str(engines),
                "runtime.profile": "tiny", "speculative.drafter": "ngram", "speculative.k": 3}
    return Config().replace(**dict(settings, **extra))


def write_yaml(path: Path, cfg: Config) -> Path:
    """cfg as a ROS 2 params file of the keys the tiny profile sets."""
    g, s, m, r = cfg.graphs, cfg.speculative, cfg.model, cfg.runtime
    params = {"model": {"target": m.target},
              "graphs": {"max_context": g.max_context, "prefill_chunk": g.prefill_chunk, "k_values": list(g.k_values),
                         "layer_skip_layers": g.layer_skip_layers, "weights": g.weights,
                         "batch_slots": g.batch_slots},
              "runtime": {"engine_dir": r.engine_dir, "profile": r.profile},
              "speculative": {"drafter": s.drafter, "k": s.k, "eagle3_head": s.eagle3_head}}
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    return path


def answer(cfg: Config, drafter: str | None = None):
    """(greedy token ids, the load's progress messages, the request's stats) of one request through a freshly
    loaded engine."""
    messages: list[str] = []
    engine = artifacts.engine(cfg, messages.append)
    result = run_one(engine, GenerateRequest(prompt=PROMPT, max_new_tokens=16, drafter=drafter))
    return list(result.token_ids), messages, result.stats


LONGER = {"graphs.max_context": 96}  # another form of the tiny profile (a folder of its own)


@pytest.fixture(scope="module")
def made_engines(tiny_models, tmp_path_factory) -> Path:
    """An engines folder with the tiny profile's form and its LONGER form made, once per module: the tests that
    need made folders copy it (made_copy) instead of exporting the same graphs again."""
    engines = tmp_path_factory.mktemp("made") / "engines"
    cfg = tiny_profile(tiny_models, engines)
    for form in (cfg, cfg.replace(**LONGER)):
        artifacts.ensure(form, lambda message: None)
    return engines


def made_copy(made_engines: Path, tmp_path: Path) -> Path:
    """A copy of made_engines of the test's own (the tests change, remake and prune its folders)."""
    shutil.copytree(made_engines, tmp_path / "engines", symlinks=True)
    return tmp_path / "engines"


def made(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith(MAKING)]


def cli(*args: str, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "spec_edge.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)


def test_switching_forms_back_and_forth_reloads(tiny_models, made_engines, tmp_path):
    """Plain -> a head (its hidden states) -> plain -> the head -> another max_context -> back: each
    form gets a folder of its own, each switch back loads it without making anything, and every
    answer is the plain greedy one (the head's answers proven to have drafted: verify calls ran)."""
    from test_eagle3 import make_head

    head, _ = make_head(tmp_path / "head", tiny_models["target"], scale=20.0)
    plain = tiny_profile(tiny_models, made_copy(made_engines, tmp_path))
    with_head = plain.replace(**{"speculative.eagle3_head": str(head), "speculative.drafter": "eagle3"})
    longer = plain.replace(**LONGER)
    want, first, _ = answer(plain)
    assert made(first) == [], first  # the module's made folder, copied: loaded as it is
    got, second, stats = answer(with_head, "eagle3")
    assert got == want and made(second)
    # a random head: verified, seldom accepted (its accept path is test_eagle3's); the switch is the point here
    assert_speculated(stats, accepted=False, what="eagle3 after the switch")
    for cfg, drafter in ((plain, None), (with_head, "eagle3")):
        got, messages, stats = answer(cfg, drafter)
        assert got == want and made(messages) == [], messages
        if drafter:
            assert_speculated(stats, accepted=False, what="eagle3 switched back")
    got, messages, _ = answer(longer)
    assert got == want and made(messages) == [], messages
    got, messages, _ = answer(plain)
    assert got == want and made(messages) == [], messages
    names = {plan.artifact_dir(cfg, "target").name for cfg in (plain, with_head, longer)}
    assert len(names) == 3 and any("-h0.1.2-" in name for name in names)
    for folder in (tmp_path / "engines" / "tiny" / "onnx").glob("[!.]*"):  # one form per folder
        manifest = json.loads((folder / "manifest.json").read_text())
        forms = {tuple(spec.get("hidden_layers", ())) for spec in manifest["graphs"].values()
                 if spec["kind"] in ("prefill", "step", "verify")}
        assert len(forms) <= 1, (folder.name, forms)


def test_the_engine_only_loads_and_refuses_what_no_build_made(tiny_models, made_engines, tmp_path):
    """Build before serve: Engine.from_config makes no file; a profile never built, or a packed copy gone, is
    refused with the command that makes it, and after the build (what every serving command runs first: here
    the module's made folder and the build's check of it) the same load makes nothing."""
    cfg = tiny_profile(tiny_models, tmp_path / "engines")
    with pytest.raises(BackendError, match=r"target graphs of profile 'tiny' is not built .*`spec-edge export`"):
        Engine.from_config(cfg, lambda message: None)
    assert not (tmp_path / "engines").exists()
    made_copy(made_engines, tmp_path)
    built: list[str] = []
    runs = artifacts.ensure(cfg, built.append)
    assert made(built) == [], built
    messages: list[str] = []
    Engine.from_config(cfg, messages.append)
    assert made(messages) == [], messages
    (packed_dir(runs["target"]) / "manifest.json").unlink()
    with pytest.raises(BackendError, match=r"not packed for this machine.*`spec-edge export`"):
        Engine.from_config(cfg, lambda message: None)


def test_a_foreign_graph_is_ignored_and_a_stale_one_remade(tiny_models, made_engines, tmp_path):
    """A graph of another form in the folder (as an older version grew folders) is not loaded; a graph the
    plan runs whose spec differs is made again; neither stops the engine."""
    cfg = tiny_profile(tiny_models, made_copy(made_engines, tmp_path))
    want, _, _ = answer(cfg)
    exported = plan.artifact_dir(cfg, "target")
    fused = exported.parent / f"{exported.name}_fused"
    manifest = json.loads((fused / "manifest.json").read_text())
    manifest["graphs"]["verify_9"] = {"kind": "verify", "width": 9, "rows": 1, "hidden_layers": [0, 1, 2]}
    (fused / "verify_9.onnx").write_bytes((fused / "verify_4.onnx").read_bytes())
    (fused / "manifest.json").write_text(json.dumps(manifest))
    got, messages, _ = answer(cfg)
    assert got == want
    manifest = json.loads((exported / "manifest.json").read_text())
    manifest["graphs"]["verify_4"]["hidden_layers"] = [0, 1, 2]  # not what the plan runs: made again
    (exported / "manifest.json").write_text(json.dumps(manifest))
    got, messages, _ = answer(cfg)
    assert got == want and any("1 graph added" in m for m in messages), messages


@pytest.mark.release
def test_an_export_and_a_start_of_the_same_profile_at_once(tiny_models, tmp_path):
    """`spec-edge export` and `spec-edge generate` of one profile started together on an empty engines
    folder: each graph is made once (whichever process waits for the other's lock then finds it made),
    both succeed, and a later start loads the folder without making anything and answers the same."""
    profile = write_yaml(tmp_path / "tiny.yaml", tiny_profile(tiny_models, tmp_path / "engines"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ask = ["generate", "--config", str(profile), "--prompt", PROMPT, "--max-new-tokens", "16", "--drafter", "none",
           "--json"]
    procs = [subprocess.Popen([sys.executable, "-m", "spec_edge.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for args in (["export", "--config", str(profile)], ask)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outs]
    later = cli(*ask)
    assert later.returncode == 0 and not [line for line in later.stderr.splitlines() if line.startswith(MAKING)]
    assert json.loads(outs[1][0])["token_ids"] == json.loads(later.stdout)["token_ids"]
    graph_lines = [line for _, err in outs for line in err.splitlines() if line.startswith("[export] target: graph ")]
    graphs = plan.graph_plan(tiny_profile(tiny_models, tmp_path), "target")
    assert len(graph_lines) == len(graphs), graph_lines  # each exported once, by one of the two


def kill_when(args: list[str], marker: str) -> str:
    """Start `spec-edge args`, kill -9 it as soon as a stderr line starts with marker; its stderr so far."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "spec_edge.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(marker):
            time.sleep(0.3)  # inside the graph's export
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


@pytest.mark.release
def test_kill_9_mid_export_leaves_a_folder_the_next_command_uses(tiny_models, tmp_path):
    """kill -9 while a new folder is made, then while a grown plan (a new k) adds to a made one: each time
    the next command works without a manual step, and the made folder keeps serving as it was."""
    cfg = tiny_profile(tiny_models, tmp_path / "engines")
    profile = write_yaml(tmp_path / "tiny.yaml", cfg)
    kill_when(["export", "--config", str(profile)], "[export] target: graph 2/")
    exported = plan.artifact_dir(cfg, "target")
    assert not exported.exists()  # a reader never sees the half-made folder
    ask = ["generate", "--config", str(profile), "--prompt", PROMPT, "--max-new-tokens", "16", "--json"]
    first = cli(*ask)
    assert first.returncode == 0, first.stderr[-2000:]
    manifest = (exported / "manifest.json").read_text()
    kill_when(["export", "--config", str(profile), "--k-values", "3", "5"], "[export] target: graph 1/1")
    assert (exported / "manifest.json").read_text() == manifest  # as it was
    again = cli(*ask)
    assert again.returncode == 0 and json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    assert not [line for line in again.stderr.splitlines() if line.startswith(MAKING)], again.stderr
    refused = cli(*ask, "--k", "5")  # a request's k: never a graph build (issue 50); the command that builds it
    assert refused.returncode == 2 and "`spec-edge export --k-values 3 5`" in refused.stderr, refused.stderr[-2000:]
    built = cli("export", "--config", str(profile), "--k-values", "3", "5")  # the interrupted growth, finished
    assert built.returncode == 0, built.stderr[-2000:]
    grown = cli(*ask, "--k", "5")
    assert grown.returncode == 0, grown.stderr[-2000:]
    assert json.loads(grown.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    assert not list(exported.parent.glob(".*.tmp*")) and not list(exported.glob(".*.tmp*"))


def test_engines_lists_and_prunes_only_unused_folders(tiny_models, made_engines, tmp_path):
    engines = made_copy(made_engines, tmp_path)  # the profile's form and LONGER, a form no profile names
    cfg = tiny_profile(tiny_models, engines)
    profile = write_yaml(tmp_path / "tiny.yaml", cfg)
    listed = cli("engines", "--engine-dir", str(engines), "--config", str(profile))
    assert listed.returncode == 0, listed.stderr
    used, unused = plan.artifact_dir(cfg, "target"), plan.artifact_dir(cfg.replace(**LONGER), "target")
    for name in (used.name, f"{used.name}_fused_packed", unused.name):
        assert f"tiny/onnx/{name}\n" in listed.stdout
    assert f"used by: {profile}" in listed.stdout and "UNUSED" in listed.stdout
    pruned = cli("engines", "--engine-dir", str(engines), "--config", str(profile), "--prune")
    assert pruned.returncode == 0, pruned.stderr
    left = sorted(path.name for path in (engines / "tiny" / "onnx").iterdir() if not path.name.startswith("."))
    assert left and all(name.startswith(used.name) for name in left), left
    assert not any(name.startswith(unused.name) for name in left)
    got, messages, _ = answer(cfg)
    assert made(messages) == []

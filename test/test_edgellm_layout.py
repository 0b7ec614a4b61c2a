"""The engine folders `spec-edge build` leaves, as spec_edge/edgellm_layout.py describes them, read back by the
pinned tensorrt-edgellm wheel's own readers; the builder limits against Edge-LLM's deployment checks for every
k and for the EAGLE-3 tree; Edge-LLM's names against the native binary.

The wheel's readers (no GPU needed, pure Python in the wheel):
  scripts/sweep_eagle3_configs.py      _read_engine_limits(engine_dir): base_config.json builder_config
  experimental/server/runtime/engine_layout.py   detect_engine_type (llm.engine / spec_base + spec_draft),
                                                 inspect_bundle (visual/visual.engine, media_dir: a VLM profile)
  experimental/server/runtime/engine.py          _read_bundle_builder_config, _resolve_spec_decode_runtime_options
                                                 (base_config.json + draft_config.json), _resolve_tree_size
Edge-LLM's C++ deployment checks are read, not run (cpp/runtime/config/llmEngineConfig.cpp createDeploymentConfig:
draftingStep x draftingTopK <= draft.maxDraftTreeSize, verifySize <= base.maxVerifyTreeSize; eagleDecoder.cpp: the
verify tree is picked from 1 + top_k + (steps - 1) x top_k^2 candidates, the accept-token step feeds up to
draftingStep + 1 tokens through the draft engine): edgellm_layout.tree_problems states them, and this test holds
the builder limits to them and runs every combination NVIDIA's sweep (_generate_combos) generates against them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import edgellm_native
from spec_edge.config import ConfigError, load
from spec_edge import edgellm_layout as layout

ROOT = Path(__file__).resolve().parents[1]
TENSORRT = [p for p in sorted((ROOT / "config").glob("*.yaml")) if load(p).runtime.backend == "tensorrt"]

pytestmark = pytest.mark.skipif(edgellm_native.package_dir() is None, reason="tensorrt-edgellm is not installed")


def _write(cfg, root: Path) -> Path:
    """Every file layout.engine_files(cfg) names, under root (the profile dir); engines empty."""
    for rel, content in layout.engine_files(cfg).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.touch()
        else:
            path.write_text(json.dumps(content))
    return root


def _wheel():
    from experimental.server.runtime import engine, engine_layout
    from tensorrt_edgellm.scripts import sweep_eagle3_configs

    return engine, engine_layout, sweep_eagle3_configs


@pytest.mark.parametrize("path", TENSORRT, ids=[p.stem for p in TENSORRT])
def test_every_engine_folder_reads_back_with_the_wheels_readers(path, tmp_path):
    engine, engine_layout, sweep = _wheel()
    cfg = load(path)
    root = _write(cfg, tmp_path)
    record = layout.engine_record(cfg)
    target = root / record["engine_dir"]
    assert engine._read_bundle_builder_config(str(target))["max_input_len"] == cfg.graphs.max_context
    assert engine._read_bundle_builder_config(str(target))["max_kv_cache_capacity"] == cfg.graphs.max_context
    if cfg.speculative.drafter == "eagle3":
        assert engine_layout.detect_engine_type(str(target)) == engine_layout.EngineType.SPEC_DECODE
        limits = layout.builder_limits(cfg)["engines/eagle3"]
        assert sweep._read_engine_limits(target) == (limits["base"]["max_verify_tree_size"], 1)
        assert record["draft_engine_dir"] == record["engine_dir"]  # LLMRuntime reads both from one folder
        assert layout.read_builder_config(target, "draft")["max_draft_tree_size"] == \
            limits["draft"]["max_draft_tree_size"]
    else:
        assert engine_layout.detect_engine_type(str(target)) == engine_layout.EngineType.LLM
        with pytest.raises(FileNotFoundError):
            sweep._read_engine_limits(target)
    bundle = engine_layout.inspect_bundle(str(target))  # the wheel's server reads the visual engine so
    if layout.visual_limits(cfg):
        assert bundle.visual_dir == str(root / record["visual_engine_dir"]) and bundle.media_dir == str(target)
        assert layout.read_builder_config(root / record["visual_engine_dir"], "visual") == layout.visual_limits(cfg)
    else:
        assert bundle.visual_dir is None and bundle.media_dir == "" and record["visual_engine_dir"] is None
    if cfg.graphs.batch_slots > 1:
        batch = root / record["batch_engine_dir"]
        assert engine_layout.detect_engine_type(str(batch)) == engine_layout.EngineType.LLM
        assert engine._read_bundle_builder_config(str(batch))["max_batch_size"] == cfg.graphs.batch_slots


def test_the_old_hand_written_layout_is_not_what_edgellm_reads(tmp_path):
    """The layout the adapter used to read (config.json + eagle_draft.engine beside spec_base.engine): the
    wheel's readers reject it, as the runtime would; the check above can fail."""
    engine, engine_layout, sweep = _wheel()
    for name in ("spec_base.engine", "eagle_draft.engine"):
        (tmp_path / name).touch()
    (tmp_path / "config.json").write_text(json.dumps({"builder_config": {"max_input_len": 96}}))
    assert engine_layout.detect_engine_type(str(tmp_path)) == engine_layout.EngineType.UNKNOWN
    with pytest.raises(FileNotFoundError):
        sweep._read_engine_limits(tmp_path)
    with pytest.raises(layout.ManifestError, match="base_config.json"):
        layout.read_builder_config(tmp_path, "base")


@pytest.mark.parametrize("path", [p for p in TENSORRT if load(p).speculative.drafter == "eagle3"],
                         ids=lambda p: p.stem)
def test_draft_and_verify_room_for_every_k_and_the_tree(path, tmp_path):
    """Every k in k_values runs as a chain (k + 1 verified, k + 1 accepted through the draft), and Edge-LLM's
    default tree and a tree setting run on the same engines (tree_problems: Edge-LLM's checks); the wheel's server
    resolves the chain's drafting shape from these engine folders as we make it."""
    engine, _, _ = _wheel()
    cfg = load(path)
    root = _write(cfg, tmp_path)
    base = layout.read_builder_config(root / "engines/eagle3", "base")
    draft = layout.read_builder_config(root / "engines/eagle3", "draft")
    default = layout.EagleTree(engine._DEFAULT_DRAFT_TOP_K, engine._DEFAULT_DRAFT_STEP,
                               engine._DEFAULT_VERIFY_TREE_SIZE)
    assert default == layout.DEFAULT_TREE
    trees = [layout.EagleTree(1, k, k + 1) for k in cfg.graphs.k_values] + [default]
    k = cfg.speculative.k
    tree_cfg = cfg.replace(**{"speculative.eagle3_tree": [8, k, 8 * k // 2 + 1]})
    trees.append(layout.eagle3_tree(tree_cfg))
    assert layout.builder_limits(tree_cfg) == layout.builder_limits(cfg)  # a tree within the default: no rebuild
    for tree in trees:
        assert layout.tree_problems(tree, base, draft) == [], tree
    options = engine._resolve_spec_decode_runtime_options(str(root / "engines/eagle3"), "eagle3", None, 1, k, k + 1)
    assert (options.top_k, options.step, options.verify_size) == (1, k, k + 1)
    # the limits the build used to write fail the accept-token step at k = max(k_values)
    k_max = max(cfg.graphs.k_values)
    assert layout.tree_problems(layout.EagleTree(1, k_max, k_max + 1), base, {"max_draft_tree_size": k_max}) != []


@pytest.mark.parametrize("path", [p for p in TENSORRT if load(p).speculative.drafter == "eagle3"],
                         ids=lambda p: p.stem)
def test_every_combination_nvidias_sweep_runs_is_accepted(path, tmp_path):
    """NVIDIA's own EAGLE-3 sweep (tensorrt_edgellm/scripts/sweep_eagle3_configs.py, run here: _read_engine_limits
    on our engine folder, _generate_combos over its default grid) generates drafting shapes Edge-LLM runs; every one
    is accepted by tree_problems on the engines we build (the draft has room for the grid's widest proposal), and
    the wheel's server passes each through for an EAGLE-3 bundle (_resolve_spec_decode_runtime_options; its
    _resolve_tree_size bound is MTP's)."""
    engine, _, sweep = _wheel()
    assert (tuple(sweep._DEFAULT_TOP_KS), tuple(sweep._DEFAULT_DRAFT_STEPS)) == \
        (layout.SWEEP_TOP_KS, layout.SWEEP_DRAFT_STEPS)
    cfg = load(path)
    folder = _write(cfg, tmp_path) / "engines/eagle3"
    base, draft = layout.read_builder_config(folder, "base"), layout.read_builder_config(folder, "draft")
    max_ts, _ = sweep._read_engine_limits(folder)
    combos = sweep._generate_combos(max_ts, sweep._DEFAULT_TOP_KS, sweep._DEFAULT_DRAFT_STEPS)
    assert len(combos) >= 30 and any(vts > top_k * steps + 1 for top_k, steps, vts in combos)  # the old bound's
    for top_k, steps, vts in combos:
        assert layout.tree_problems(layout.EagleTree(top_k, steps, vts), base, draft) == [], (top_k, steps, vts)
        options = engine._resolve_spec_decode_runtime_options(str(folder), "eagle3", None, top_k, steps, vts)
        assert (options.top_k, options.step, options.verify_size) == (top_k, steps, vts)


def test_a_wider_tree_widens_the_engines_and_bad_trees_are_refused():
    cfg = load(ROOT / "config" / "smollm2_trt_eagle3.yaml")
    k = cfg.speculative.k
    wide = cfg.replace(**{"speculative.eagle3_tree": [60, k, 70]})
    limits = layout.builder_limits(wide)["engines/eagle3"]
    assert limits["draft"]["max_draft_tree_size"] == 60 * k > layout.SWEEP_DRAFT_CAPACITY
    assert limits["base"]["max_verify_tree_size"] == 70
    for bad in ([2, k], [2, k + 1, 5], [0, k, 3]):
        with pytest.raises(ConfigError, match="eagle3_tree must be"):
            cfg.replace(**{"speculative.eagle3_tree": bad})
    with pytest.raises(ConfigError, match="needs runtime.backend: tensorrt"):
        load(ROOT / "config" / "smollm2_eagle3.yaml").replace(**{"speculative.eagle3_tree": [2, 4, 5]})
    room = ({"max_verify_tree_size": 60}, {"max_draft_tree_size": 60})
    assert layout.tree_problems(layout.EagleTree(1, k, k), *room) == []  # a shorter chain verify: Edge-LLM runs it
    # a chain scores k + 1 candidates (eagleDecoder.cpp draftFullTableLength); a (2, 3) tree 1 + 2 + 2 x 4 = 11
    assert layout.candidate_nodes(layout.EagleTree(1, k, k + 1)) == k + 1
    assert layout.candidate_nodes(layout.EagleTree(2, 3, 11)) == 11
    assert "exceeds the 11 candidates" in " ".join(layout.tree_problems(layout.EagleTree(2, 3, 12), *room))
    assert "Drafting configuration exceeds" in " ".join(layout.tree_problems(layout.EagleTree(16, 4, 60), *room))
    assert "Verification size exceeds" in " ".join(layout.tree_problems(layout.EagleTree(10, 6, 61), *room))


def test_tree_problems_quotes_edgellms_own_messages():
    """The refusals tree_problems restates are Edge-LLM's (createDeploymentConfig): their text is in the binary."""
    binary = edgellm_native.extension(edgellm_native.package_dir()).read_bytes()
    for quoted in (b". Drafting configuration exceeds engine proposal size capability.",
                   b". Verification size exceeds base engine maximum verification size.",
                   b" must be positive (>= 1)."):
        assert quoted in binary, quoted


def test_edgellm_names_are_the_wheels_and_the_binarys():
    """The artefact names and builder_config keys: the wheel's own constants, and strings of the native binary
    (the payload the API snapshot is read from); the limits are settable LLMBuilderConfig fields whose binary
    defaults give Edge-LLM's default tree capacity."""
    _, engine_layout, _ = _wheel()
    assert (layout.ENGINE_FILE["llm"], layout.ENGINE_FILE["base"], layout.ENGINE_FILE["draft"]) == \
        (engine_layout.LLM_ENGINE_FILE, engine_layout.SPEC_BASE_ENGINE_FILE, engine_layout.SPEC_DRAFT_ENGINE_FILE)
    binary = edgellm_native.extension(edgellm_native.package_dir()).read_bytes()
    keys = {key for cfg in map(load, TENSORRT) for roles in layout.builder_limits(cfg).values()
            for fields in roles.values() for key in fields}
    for name in [*layout.ENGINE_FILE.values(), *layout.CONFIG_FILE.values(), layout.BUILDER_CONFIG, *keys]:
        assert name.encode() in binary, name
    builder = json.loads(edgellm_native.SNAPSHOT.read_text())["api"]["LLMBuilderConfig"]
    assert all(builder["members"][key]["settable"] for key in keys)
    assert builder["defaults"]["max_draft_tree_size"] == builder["defaults"]["max_verify_tree_size"] == \
        layout.DEFAULT_TREE_CAPACITY

"""Engine manifests, rebuild-only-what-changed, and the plan/build command lines - without TensorRT
(the TensorRT calls are replaced by fakes that write bytes)."""
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from spec_edge.config import Config, ConfigError, from_params, load
from spec_edge.device import builder, commands, memory, profiles
from spec_edge.device.manifest import ManifestError, check_engines, identity_config, model_identity, profile_dir
from spec_edge.device.engine_file import engine_stamp
from spec_edge.device.specs import (BuildError, EngineSpec, engine_specs, external_data_files, file_sha256,
                                    onnx_quantization, onnx_token_width)
from spec_edge.graphs import export, io_names
from spec_edge.runtime.backends.onnxruntime import cpu_session

TRT_VERSION = "10.13.0.35"
GPU = {"name": "NVIDIA Thor", "compute_capability": "11.0"}
TINY_HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 512, "tie_word_embeddings": True, "bos_token_id": 1,
           "eos_token_id": 2}


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "Tiny-Llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_HF))
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return folder


def make_cfg(tmp_path, checkpoint, **extra) -> Config:
    params = {"model.target": str(checkpoint), "runtime.backend": "tensorrt", "runtime.profile": "tiny",
              "runtime.engine_dir": str(tmp_path / "engines"), "graphs.max_context": 64,
              "graphs.prefill_chunk": 16, "graphs.k_values": [4], "graphs.dtype": "bfloat16",
              "graphs.layer_skip_layers": 1, "speculative.drafter": "ngram", "speculative.k": 4}
    params.update(extra)
    return from_params(params)


def write_graph(path: Path, width, weights_file: str = "weights.bin", seed: int = 0, prefill=False) -> None:
    """A stand-in graph with the spec_edge I/O names, width T (None = dynamic), external weights."""
    dim = "T" if width is None else width
    inputs = [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, dim]),
              helper.make_tensor_value_info("position", TensorProto.INT64, [1]),
              *(helper.make_tensor_value_info(name, TensorProto.BFLOAT16, [1, 64, 8])
                for name in io_names.cache_inputs(2))]
    if prefill:
        inputs.append(helper.make_tensor_value_info("last_index", TensorProto.INT64, [1]))
    weight = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((64, 16)).astype(np.float32), "w")
    node = helper.make_node("Identity", ["w"], ["logits"])
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                                                   [64, 16])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.stem + "_" + weights_file,
                    size_threshold=0)


def fake_export(cfg):
    folder = profile_dir(cfg) / "onnx" / "target"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "step_1.onnx").exists():
        write_graph(folder / "prefill_16.onnx", 16, prefill=True)
        write_graph(folder / "step_1.onnx", 1)
        write_graph(folder / "verify_5.onnx", 5)
        write_graph(folder / "layerskip1_step_1.onnx", 1)
    return {"target": folder}


@pytest.fixture
def fake_trt(monkeypatch):
    """build() with TensorRT replaced: records which engines it builds."""
    built = []

    class FakeTrt:
        __version__ = TRT_VERSION

    def fake_build_engine(spec, out_path, **kw):
        built.append(spec.name)
        out_path.write_bytes(f"engine {spec.name} {spec.widths} {len(built)}".encode())
        return {"build_seconds": 0.0, "profiles": {str(w): i for i, w in enumerate(spec.widths)},
                "context_memory": 1 << 20}

    monkeypatch.setattr(builder, "import_tensorrt", lambda: FakeTrt)
    monkeypatch.setattr(builder, "gpu_identity", lambda: dict(GPU))
    monkeypatch.setattr(builder, "export_all", lambda cfg, progress: fake_export(cfg))
    monkeypatch.setattr(builder, "build_engine", fake_build_engine)
    monkeypatch.setattr(memory, "read_device_memory", lambda: None)
    return built


def quiet(_msg):
    pass


def test_build_then_rebuild_only_what_changed(tmp_path, checkpoint, fake_trt):
    cfg = make_cfg(tmp_path, checkpoint)
    manifest = builder.build(cfg, progress=quiet)
    assert sorted(fake_trt) == ["target_prefill_16", "target_step_1", "target_verify_5"]
    assert manifest["layout"] == "per_graph"
    assert manifest["tensorrt_version"] == TRT_VERSION and manifest["gpu"] == GPU
    assert manifest["k"] == 4 and manifest["max_context"] == 64 and manifest["precision"] == "bfloat16"
    entry = manifest["engines"]["target_verify_5"]
    assert entry["widths"] == [5] and entry["kinds"] == {"5": "verify"} and len(entry["sha256"]) == 64
    assert manifest["engines"]["target_prefill_16"]["kinds"] == {"16": "prefill"}
    on_disk = json.loads((profile_dir(cfg) / "manifest.json").read_text())
    assert on_disk == manifest

    fake_trt.clear()
    builder.build(cfg, progress=quiet)
    assert fake_trt == []  # nothing changed

    folder = profile_dir(cfg) / "onnx" / "target"
    write_graph(folder / "verify_5.onnx", 5, seed=1)  # new weights for one graph
    builder.build(cfg, progress=quiet)
    assert fake_trt == ["target_verify_5"]

    fake_trt.clear()
    (profile_dir(cfg) / "target_step_1.engine").write_bytes(b"garbage")  # a damaged engine
    builder.build(cfg, progress=quiet)
    assert fake_trt == ["target_step_1"]

    fake_trt.clear()
    builder.build(cfg, progress=quiet, force=True)
    assert len(fake_trt) == 3
    check_engines(cfg, trt_version=TRT_VERSION, gpu=GPU)


def test_layerskip_profile_builds_the_layerskip_engine(tmp_path, checkpoint, fake_trt):
    cfg = make_cfg(tmp_path, checkpoint, **{"speculative.drafter": "layerskip"})
    manifest = builder.build(cfg, progress=quiet)
    assert "target_layerskip1_step_1" in fake_trt
    assert manifest["engines"]["target_layerskip1_step_1"]["role"] == "layerskip"
    check_engines(cfg)


def test_plan_runs_before_anything(tmp_path, checkpoint, fake_trt, monkeypatch):
    cfg = make_cfg(tmp_path, checkpoint, **{"memory.device_memory_gb": 1.0, "memory.os_ros_reserve_gb": 0.5})
    with pytest.raises(memory.PlanError):
        builder.build(cfg, progress=quiet)
    assert fake_trt == [] and not profile_dir(cfg).exists()


def test_quantized_profile_needs_a_quantized_export(tmp_path, checkpoint, fake_trt):
    """An engine spec over an unquantized graph is refused for a quantized profile (graphs/qdq.py writes the
    Q/DQ graphs in export_all; this is the check that no bf16 engine is built in their place)."""
    cfg = make_cfg(tmp_path, checkpoint, **{"graphs.weights": "fp8"})
    plain = tmp_path / "plain.onnx"
    write_graph(plain, 1)
    spec = EngineSpec(name="target", role="target", onnx=plain, widths=(1,), kinds={1: "step"}, dynamic=False)
    with pytest.raises(BuildError, match="graphs.weights=fp8"):
        builder.check_quantization(cfg, [spec])
    assert fake_trt == []


def test_onnx_quantization_detects_fp8_weights(tmp_path):
    w = helper.make_tensor("w_fp8", TensorProto.FLOAT8E4M3FN, [2, 2], [1.0, 2.0, 0.5, 1.0])
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    dq = helper.make_node("DequantizeLinear", ["w_fp8", "s"], ["w"])
    graph = helper.make_graph([dq], "g", [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, 2])], [w, scale])
    path = tmp_path / "q.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    assert onnx_quantization(path) == "fp8"
    plain = tmp_path / "plain.onnx"
    write_graph(plain, 1)
    assert onnx_quantization(plain) == "none"


def test_dynamic_graph_gives_one_engine_with_a_profile_per_width(tmp_path, checkpoint):
    cfg = make_cfg(tmp_path, checkpoint, **{"graphs.k_values": [3, 4]})
    folder = tmp_path / "onnx"
    folder.mkdir()
    write_graph(folder / "dynamic.onnx", None)
    (spec,) = engine_specs(cfg, {"target": folder})
    assert spec.dynamic and spec.name == "target" and spec.widths == (1, 4, 5, 16)
    assert spec.kinds == {1: "step", 4: "verify", 5: "verify", 16: "prefill"}
    assert external_data_files(folder / "dynamic.onnx") == [folder / "dynamic_weights.bin"]


# -- the runtime's refusals ----------------------------------------------------------------------


@pytest.fixture
def built(tmp_path, checkpoint, fake_trt):
    cfg = make_cfg(tmp_path, checkpoint)
    builder.build(cfg, progress=quiet)
    return cfg


def test_check_passes_on_a_good_build(built):
    manifest = check_engines(built, trt_version=TRT_VERSION, gpu=GPU)
    assert set(manifest["engines"]) == {"target_prefill_16", "target_step_1", "target_verify_5"}
    check_engines(built, verify="quick")


def test_missing_manifest(tmp_path, checkpoint):
    cfg = make_cfg(tmp_path, checkpoint)
    with pytest.raises(ManifestError, match="no engines for profile 'tiny'.*spec-edge build"):
        check_engines(cfg)


def test_unreadable_manifest(built):
    (profile_dir(built) / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="missing or unreadable"):
        check_engines(built)


def test_missing_engine_file(built):
    (profile_dir(built) / "target_verify_5.engine").unlink()
    with pytest.raises(ManifestError, match=r"target_verify_5.engine is missing.*spec-edge build"):
        check_engines(built)


def test_corrupted_engine_same_size(built):
    path = profile_dir(built) / "target_step_1.engine"
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"target_step_1.engine is corrupted \(sha256"):
        check_engines(built)
    with pytest.raises(ManifestError, match=r"target_step_1.engine is corrupted \(its first/last MiB"):
        check_engines(built, verify="quick")  # the stamp hashes the first and last MiB


def test_quick_check_misses_the_middle_of_a_big_engine_the_full_one_does_not(built):
    """What the runtime checks at start (quick) and what `spec-edge build --check` checks (full)."""
    path = profile_dir(built) / "target_step_1.engine"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    path.write_bytes(bytes(data))
    manifest_path = profile_dir(built) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["engines"]["target_step_1"]
    entry["size"], entry["sha256"], entry["stamp"] = len(data), file_sha256(path), engine_stamp(path)
    manifest_path.write_text(json.dumps(manifest))
    data[len(data) // 2] ^= 0xFF  # a flipped byte outside the first and last MiB
    path.write_bytes(bytes(data))
    check_engines(built, verify="quick")
    with pytest.raises(ManifestError, match=r"target_step_1.engine is corrupted \(sha256"):
        check_engines(built, verify="full")
    del entry["stamp"]  # a manifest from before stamps: the quick check hashes everything
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"corrupted \(sha256"):
        check_engines(built, verify="quick")
    with pytest.raises(ValueError, match="verify='fast'"):
        check_engines(built, verify="fast")



def test_truncated_engine(built):
    path = profile_dir(built) / "target_step_1.engine"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ManifestError, match="corrupted \\(size"):
        check_engines(built, verify="quick")


def test_config_mismatch_names_the_key(built):
    other = built.replace(**{"graphs.max_context": 128})
    with pytest.raises(ManifestError, match="graphs.max_context: engines have 64, config says 128"):
        check_engines(other)
    other = built.replace(**{"graphs.k_values": [3], "speculative.k": 3})
    with pytest.raises(ManifestError, match="graphs.k_values"):
        check_engines(other)


def test_checkpoint_changed(built, checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\1" * 100)
    with pytest.raises(ManifestError, match="target checkpoint changed"):
        check_engines(built)


def test_other_tensorrt_or_gpu(built):
    with pytest.raises(ManifestError, match="TensorRT 10.13.0.35, this is TensorRT 10.14"):
        check_engines(built, trt_version="10.14.1")
    with pytest.raises(ManifestError, match="this GPU"):
        check_engines(built, gpu={"name": "Orin", "compute_capability": "8.7"})


def test_missing_role(built):
    other = built.replace(**{"speculative.drafter": "layerskip"})
    path = profile_dir(built) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"] = identity_config(other)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="no layerskip engine"):
        check_engines(other)


def test_identity_depends_on_config_and_weights():
    a = model_identity({"graphs.max_context": 64}, {"target": "abc"})
    assert a == model_identity({"graphs.max_context": 64}, {"target": "abc"})
    assert a != model_identity({"graphs.max_context": 65}, {"target": "abc"})
    assert a != model_identity({"graphs.max_context": 64}, {"target": "abd"})


# -- profiles and the command lines --------------------------------------------------------------

PROFILES = sorted((Path(__file__).resolve().parents[1] / "config").glob("thor_*.yaml"))


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_thor_profiles_load_and_fit(path):
    cfg = load(path)
    assert cfg.runtime.backend == "tensorrt" and cfg.runtime.profile == path.stem
    for layout in ("shared", "per_graph"):
        p = profiles.plan_for_config(cfg, None, layout)
        assert p.fits, p.table()
    assert cfg.graphs.max_context <= profiles.plan_for_config(cfg, None, "shared").largest_max_context


def test_there_are_thor_profiles():
    stems = {p.stem for p in PROFILES}
    assert {"thor_llama31_8b_bf16", "thor_llama31_8b_fp8", "thor_qwen3_8b_bf16",
            "thor_llama31_8b_layerskip"} <= stems


def test_model_config_without_weights():
    assert profiles.model_config("/models/Llama-3.1-8B-Instruct").n_layers == 32
    assert profiles.model_config("qwen3-0.6b").qk_norm
    with pytest.raises(ConfigError, match="cannot tell the architecture"):
        profiles.model_config("/models/Unknown-Model")


def test_plan_main(capsys):
    assert commands.plan_main(["thor_llama31_8b_bf16", "--config-only"]) == 0
    out = capsys.readouterr().out
    assert "target weights" in out and "largest max_context" in out and "tokens/verify" in out
    assert commands.plan_main(["thor_llama31_8b_bf16", "--config-only", "--max-context", "131072",
                            "--layout", "per_graph"]) in (0, 1)
    assert commands.plan_main(["no_such_profile"]) == 2


def test_plan_main_refuses(tmp_path, capsys):
    profile = tmp_path / "small.yaml"
    profile.write_text("/**:\n  ros__parameters:\n    model: {target: /models/Llama-3.1-8B-Instruct}\n"
                       "    graphs: {max_context: 8192, dtype: bfloat16}\n"
                       "    runtime: {backend: tensorrt, profile: small}\n"
                       "    memory: {device_memory_gb: 16.0}\n")
    assert commands.plan_main([str(profile), "--config-only"]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_build_main_check_reports_missing_engines(tmp_path, capsys):
    profile = tmp_path / "p.yaml"
    profile.write_text(f"/**:\n  ros__parameters:\n    model: {{target: /models/Llama-3.1-8B-Instruct}}\n"
                       f"    graphs: {{dtype: bfloat16}}\n"
                       f"    runtime: {{backend: tensorrt, profile: p, engine_dir: {tmp_path / 'e'}}}\n")
    assert commands.build_main([str(profile), "--check"]) == 1
    assert "spec-edge build" in capsys.readouterr().err


def test_engine_sizes_larger_than_planned_are_reported(built):
    manifest = json.loads((profile_dir(built) / "manifest.json").read_text())
    assert builder.report_engine_sizes(built, manifest, quiet) == []  # tiny fake engines
    for entry in manifest["engines"].values():
        entry["size"] = 10 ** 9  # as if TensorRT had stored a weight copy per profile
    warnings = builder.report_engine_sizes(built, manifest, quiet)
    assert len(warnings) == 1 and "MORE than planned" in warnings[0]


def test_profile_docs_are_current(tmp_path):
    """config/thor_*.yaml plan comments and docs/thor_profiles.md match the code (regenerate with
    commands.write_profile_docs(Path('config'), Path('docs/thor_profiles.md')))."""
    import shutil
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "config", tmp_path / "config")
    commands.write_profile_docs(tmp_path / "config", tmp_path / "thor_profiles.md")
    for path in PROFILES:
        assert (tmp_path / "config" / path.name).read_text() == path.read_text(), path.name
    assert (tmp_path / "thor_profiles.md").read_text() == (root / "docs" / "thor_profiles.md").read_text()


def test_ros_args_are_ignored():
    assert commands._without_ros_args(["p", "--ros-args", "-r", "__node:=x"]) == ["p"]


def test_shared_layout_build(tmp_path, checkpoint, fake_trt, monkeypatch):
    """With a dynamic-width export: one engine per model, a profile per width, weights counted once."""
    def dynamic_export(cfg):
        folder = profile_dir(cfg) / "onnx" / "target"
        folder.mkdir(parents=True, exist_ok=True)
        write_graph(folder / "dynamic.onnx", None)
        write_graph(folder / "layerskip1_dynamic.onnx", None)
        return {"target": folder}

    monkeypatch.setattr(builder, "export_all", lambda cfg, progress: dynamic_export(cfg))
    monkeypatch.setattr(profiles, "engine_layout", lambda: "shared")
    cfg = make_cfg(tmp_path, checkpoint, **{"speculative.drafter": "layerskip"})
    manifest = builder.build(cfg, progress=quiet)
    assert manifest["layout"] == "shared"
    assert sorted(fake_trt) == ["layerskip1", "target"]
    target = manifest["engines"]["target"]
    assert target["widths"] == [1, 5, 16] and target["dynamic"]
    assert target["profiles"] == {"1": 0, "5": 1, "16": 2}
    assert target["kinds"] == {"1": "step", "5": "verify", "16": "prefill"}
    assert manifest["engines"]["layerskip1"]["role"] == "layerskip"
    check_engines(cfg, trt_version=TRT_VERSION, gpu=GPU)
    lines = dict(profiles.plan_for_config(cfg, None, "shared").lines)
    assert lines["target weights (1 engine)"] == memory.weight_bytes(profiles.model_config(str(checkpoint)),
                                                                     "bfloat16")


# -- build_engine against a stand-in for the documented TensorRT 10 Python API --------------------


class FakeTensorRT:
    """Records how build_engine drives TensorRT (create_network flags, parser, pool limit, timing
    cache, optimization profiles, progress monitor); not TensorRT itself."""
    __version__ = TRT_VERSION

    def __init__(self, parse_ok=True, build_ok=True):
        fake = self
        self.log = {"profiles": [], "cache_in": None}

        class Logger:
            WARNING = 2

            def __init__(self, level):
                self.level = level

        class NetworkDefinitionCreationFlag:
            STRONGLY_TYPED = 1

        class MemoryPoolType:
            WORKSPACE = "workspace"

        class IProgressMonitor:
            def __init__(self):
                pass

        class Tensor:
            def __init__(self, name, shape):
                self.name, self.shape = name, shape

        class Network:
            def __init__(self, flags):
                fake.log["flags"] = flags
                self.inputs = []

            @property
            def num_inputs(self):
                return len(self.inputs)

            def get_input(self, i):
                return self.inputs[i]

        class Error:
            def __str__(self):
                return "In node 3 (Foo): UNSUPPORTED_NODE"

        class OnnxParser:
            def __init__(self, network, logger):
                self.network = network
                self.num_errors = 0

            def parse_from_file(self, path):
                model = onnx.load(path, load_external_data=False)
                self.network.inputs = [Tensor(v.name, tuple(d.dim_value if d.HasField("dim_value") else -1
                                                            for d in v.type.tensor_type.shape.dim))
                                       for v in model.graph.input]
                self.num_errors = 0 if parse_ok else 1
                return parse_ok

            def get_error(self, i):
                return Error()

        class Cache:
            def __init__(self, data):
                self.data = bytes(data)

            def serialize(self):
                return self.data + b"+tuned"

        class Profile:
            def __init__(self):
                self.shapes = {}

            def set_shape(self, name, lo, opt, hi):
                self.shapes[name] = (lo, opt, hi)

        class BuilderConfig:
            def __init__(self):
                self.progress_monitor = None
                self.n_profiles = 0

            def set_memory_pool_limit(self, pool, size):
                fake.log[pool] = size

            def create_timing_cache(self, data):
                if fake.log["cache_in"] is None:
                    fake.log["cache_in"] = bytes(data)
                return Cache(data)

            def set_timing_cache(self, cache, ignore_mismatch):
                self.cache = cache
                return True

            def get_timing_cache(self):
                return self.cache

            def add_optimization_profile(self, profile):
                fake.log["profiles"].append(profile.shapes)
                self.n_profiles += 1
                return self.n_profiles - 1

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                return Network(flags)

            def create_builder_config(self):
                return BuilderConfig()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                monitor = config.progress_monitor
                monitor.phase_start("Building engine", None, 2)
                monitor.phase_start("Tactic selection", "Building engine", 3)
                keep_going = all(monitor.step_complete("Tactic selection", s) for s in range(3))
                monitor.phase_finish("Tactic selection")
                monitor.phase_finish("Building engine")
                fake.log["n_profiles"] = config.n_profiles
                return b"ENGINE" if build_ok and keep_going else None

        class Engine:
            num_optimization_profiles = 1

            def get_device_memory_size_for_profile_v2(self, p):
                return 1000 + p

        class SeekPosition:
            SET, CUR, END = "SET", "CUR", "END"

        class IStreamReaderV2:
            def __init__(self):
                pass

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, reader):
                """As the bindings do with an IStreamReaderV2: read until every byte is there."""
                assert isinstance(reader, IStreamReaderV2), "engines are streamed, never read whole"
                assert reader.seek(0, SeekPosition.END) and reader.seek(0, SeekPosition.SET)
                data = b""
                while chunk := reader.read(4, 0):  # TensorRT asks for 4; a chunk may be shorter
                    data += chunk
                fake.log["deserialized"] = data
                engine = Engine()
                engine.num_optimization_profiles = max(1, fake.log.get("n_profiles", 1))
                return engine

        for name, value in list(locals().items()):
            if isinstance(value, type):
                setattr(self, name, value)


def spec_for(tmp_path, dynamic=True):
    path = tmp_path / "g.onnx"
    write_graph(path, None if dynamic else 5)
    widths = (1, 5, 16) if dynamic else (5,)
    return EngineSpec("target", "target", path, widths, {w: "verify" for w in widths}, dynamic)


def test_build_engine_drives_the_documented_api(tmp_path, monkeypatch):
    fake = FakeTensorRT()
    monkeypatch.setattr(builder, "import_tensorrt", lambda: fake)
    lines = []
    cache = tmp_path / "timing.cache"
    info = builder.build_engine(spec_for(tmp_path), tmp_path / "t.engine", workspace_bytes=123,
                              timing_cache=cache, progress=lines.append)
    assert fake.log["flags"] == 1 << 1  # STRONGLY_TYPED only: precision from the ONNX
    assert fake.log["workspace"] == 123
    assert [p["tokens"] for p in fake.log["profiles"]] == [((1, w), (1, w), (1, w)) for w in (1, 5, 16)]
    assert all(p[name] == ((1, 64, 8),) * 3 for p in fake.log["profiles"] for name in io_names.cache_inputs(2))
    assert info["profiles"] == {"1": 0, "5": 1, "16": 2} and info["context_memory"] == 1002
    assert (tmp_path / "t.engine").read_bytes() == b"ENGINE" == fake.log["deserialized"]  # streamed back
    assert fake.log["cache_in"] == b"" and cache.read_bytes() == b"+tuned"
    assert any("Tactic selection" in line and line.startswith("[build]   ") for line in lines)
    fake2 = FakeTensorRT()
    monkeypatch.setattr(builder, "import_tensorrt", lambda: fake2)
    builder.build_engine(spec_for(tmp_path, dynamic=False), tmp_path / "s.engine", workspace_bytes=1,
                       timing_cache=cache, progress=quiet)
    assert fake2.log["cache_in"] == b"+tuned"  # the persisted cache is read back
    assert fake2.log["profiles"] == []  # static graph: TensorRT's implicit profile


def test_build_engine_reports_parser_errors_and_failures(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(builder, "import_tensorrt", lambda: FakeTensorRT(parse_ok=False))
    with pytest.raises(BuildError, match="cannot parse.*UNSUPPORTED_NODE"):
        builder.build_engine(spec_for(tmp_path), tmp_path / "t.engine", workspace_bytes=1,
                           timing_cache=tmp_path / "c", progress=lines.append)
    assert any("ONNX parser: In node 3" in line for line in lines)
    monkeypatch.setattr(builder, "import_tensorrt", lambda: FakeTensorRT(build_ok=False))
    with pytest.raises(BuildError, match="could not build"):
        builder.build_engine(spec_for(tmp_path), tmp_path / "t.engine", workspace_bytes=1,
                           timing_cache=tmp_path / "c", progress=quiet)
    assert not (tmp_path / "t.engine").exists()


def test_build_engine_cancel(tmp_path, monkeypatch):
    monkeypatch.setattr(builder, "import_tensorrt", lambda: FakeTensorRT())
    cancel = builder.Cancel()
    cancel.event.set()
    with pytest.raises(BuildError, match="cancelled"):
        builder.build_engine(spec_for(tmp_path), tmp_path / "t.engine", workspace_bytes=1,
                           timing_cache=tmp_path / "c", progress=quiet, cancel=cancel)


# -- the dynamic-width export (one engine per model) ----------------------------------------------


def test_dynamic_export_runs_every_width(tmp_path):
    """A tiny random Llama (qk-norm on, to cover Qwen3) exported with a symbolic T: ONNX Runtime
    gives the torch forward's logits and new keys at widths 1, 5 and 16 from the one file, and the
    layer-skip graph is exported too; a second call reuses the export."""
    import torch
    from safetensors.torch import save_file

    from spec_edge.graphs import model as model_mod
    from spec_edge.graphs.weights import config_from_hf

    hf = dict(TINY_HF, model_type="qwen3", head_dim=8, rms_norm_eps=1e-6)
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    (folder / "tokenizer.json").write_text("{}")
    mcfg = config_from_hf(hf)
    torch.manual_seed(0)
    module = model_mod.Transformer(mcfg).eval()
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.3)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(folder / "model.safetensors"))
    cfg = make_cfg(tmp_path, folder, **{"graphs.dtype": "float32", "graphs.layer_skip_layers": 1})
    out = export.export_model(cfg, "target", tmp_path / "onnx", progress=quiet, dynamic=True)
    assert onnx_token_width(out / "dynamic.onnx") is None
    assert (out / "layerskip1_dynamic.onnx").is_file()
    session = cpu_session(str(out / "dynamic.onnx"))
    k_cache, v_cache = model_mod.empty_cache(mcfg, 64)
    k_cache.normal_()
    v_cache.normal_()
    for width in (1, 5, 16):
        tokens = torch.randint(0, 64, (1, width))
        position = torch.tensor([7])
        feeds = dict(zip(io_names.cache_inputs(2), [*k_cache.numpy(), *v_cache.numpy()]))  # per-layer views
        got = session.run(None, {"tokens": tokens.numpy(), "position": position.numpy(), **feeds})
        with torch.no_grad():
            want = module(tokens, position, k_cache, v_cache)
        assert got[0].shape == (width, 64) and got[1].shape == (2, 1, width, 8)
        np.testing.assert_allclose(got[0], want[0].numpy(), atol=1e-4)
        np.testing.assert_allclose(got[1], want[1].numpy(), atol=1e-4)
    mtime = (out / "dynamic.onnx").stat().st_mtime_ns
    export.export_model(cfg, "target", tmp_path / "onnx", progress=quiet, dynamic=True)
    assert (out / "dynamic.onnx").stat().st_mtime_ns == mtime
    specs = engine_specs(cfg.replace(**{"speculative.drafter": "layerskip"}), {"target": out})
    assert [(s.name, s.role, s.widths, s.dynamic) for s in specs] == [
        ("target", "target", (1, 5, 16), True), ("layerskip1", "layerskip", (1,), True)]


def test_unused_keys_do_not_invalidate(built):
    check_engines(built.replace(**{"graphs.layer_skip_layers": 2}))  # drafter is ngram


def test_build_engines_names_itself_in_its_help(capsys):
    with pytest.raises(SystemExit):
        commands.build_main(["--help"], prog="build_engines")
    assert capsys.readouterr().out.startswith("usage: build_engines ")

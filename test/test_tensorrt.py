"""TensorRT backend. The first tests run everywhere (the module imports and refuses clearly without
TensorRT); the rest build engines for the embedded SmolLM2 and need `tensorrt` + a CUDA device, and
are skipped with the reason elsewhere."""
import importlib.util

import numpy as np
import pytest

from spec_edge.config import from_params
from spec_edge.device import builder
from spec_edge.device.manifest import ManifestError
from spec_edge.device.specs import BuildError

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def trt_cfg(tmp_path, **extra):
    params = {"model.target": "embedded", "runtime.backend": "tensorrt", "runtime.profile": "smollm2_trt",
              "runtime.engine_dir": str(tmp_path / "engines"), "graphs.max_context": 256,
              "graphs.prefill_chunk": 32, "graphs.k_values": [4], "graphs.dtype": "float16",
              "graphs.layer_skip_layers": 8, "speculative.drafter": "ngram", "speculative.k": 4}
    params.update(extra)
    return from_params(params)


def test_module_imports_without_tensorrt():
    from spec_edge.runtime.backends import tensorrt as backend
    assert hasattr(backend, "TensorRTRunner") and hasattr(backend, "load_runners")


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is installed: the missing-package path cannot be shown")
def test_clear_error_without_tensorrt(tmp_path):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner, load_runners
    cfg = trt_cfg(tmp_path)
    for make in (lambda: TensorRTRunner(cfg), lambda: load_runners(cfg)):
        with pytest.raises(BuildError, match="TensorRT's Python package is not importable"):
            make()


# ------------------------------------------------------------------------------------------------
# On a machine with TensorRT and a GPU

needs_device = pytest.mark.skipif(not (HAVE_TRT and _cuda()),
                                  reason="needs the tensorrt package and a CUDA device (Jetson Thor or a "
                                         "discrete GPU); this machine has " +
                                         ("no tensorrt" if not HAVE_TRT else "no CUDA device"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    if not (HAVE_TRT and _cuda()):
        pytest.skip("needs tensorrt and CUDA")
    tmp = tmp_path_factory.mktemp("trt")
    cfg = trt_cfg(tmp, **{"speculative.drafter": "layerskip"})
    builder.build(cfg, progress=lambda _m: None)
    return cfg


@pytest.fixture(scope="module")
def reference(engines, tmp_path_factory):
    """The ONNX Runtime runner over a float32 export of the same model and shapes."""
    from spec_edge.graphs import export
    from spec_edge.runtime.backends.onnxruntime import OrtRunner
    tmp = tmp_path_factory.mktemp("ort")
    cfg = engines.replace(**{"runtime.backend": "onnxruntime", "graphs.dtype": "float32",
                             "runtime.engine_dir": str(tmp)})
    folder = export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), progress=lambda _m: None)
    return OrtRunner(folder)


PROMPT = [1, 28, 1350, 314, 253, 1345, 30, 198, 504, 3158, 282, 4290, 314, 1345, 30, 2] * 3


def margin(row: np.ndarray) -> float:
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


@needs_device
def test_parity_with_onnxruntime(engines, reference):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner
    trt_runner = TensorRTRunner(engines)
    a = trt_runner.prefill(PROMPT, 0)
    b = reference.prefill(PROMPT, 0)
    assert np.corrcoef(a, b)[0, 1] > 0.999
    assert np.argmax(a) == np.argmax(b) or margin(b) < 0.05, f"ORT top-2 margin {margin(b)}"
    pos = len(PROMPT)
    for tokens in ([int(np.argmax(b))], PROMPT[3:8]):
        la, lb = trt_runner.forward(tokens, pos), reference.forward(tokens, pos)
        assert la.shape == lb.shape == (len(tokens), reference.vocab_size)
        for row_a, row_b in zip(la, lb):
            assert np.argmax(row_a) == np.argmax(row_b) or margin(row_b) < 0.05, \
                f"differs with ORT top-2 margin {margin(row_b)}: more than numerics"
            assert np.abs(row_a - row_b).max() < 0.25 * np.abs(row_b).max()


@needs_device
def test_argmax_on_device_matches_logits_and_eager(engines):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner
    graphed = TensorRTRunner(engines)
    eager = TensorRTRunner(engines, cuda_graphs=False)
    for runner in (graphed, eager):
        runner.prefill(PROMPT, 0)
    tokens, pos = PROMPT[:5], len(PROMPT)
    ids = graphed.argmax(tokens, pos)
    assert ids.dtype == np.int64 and ids.shape == (5,)
    assert np.array_equal(ids, eager.argmax(tokens, pos))
    assert np.array_equal(ids, np.argmax(graphed.forward(tokens, pos), axis=-1))


def greedy(runner, prompt, n):
    tok = int(np.argmax(runner.prefill(prompt, 0)))
    out, pos = [tok], len(prompt)
    while len(out) < n:
        tok = int(runner.argmax([tok], pos)[0])
        out.append(tok)
        pos += 1
    return out


def speculative(runner, drafter, prompt, n, k):
    """Greedy speculative decoding: draft k, verify k+1 in one call, keep the agreeing prefix plus
    the target's own token; rejected cache rows are simply overwritten by the next call."""
    tok = int(np.argmax(runner.prefill(prompt, 0)))
    out, seq, pos = [tok], list(prompt) + [tok], len(prompt)
    if drafter is not None:
        drafter_pos = pos
    while len(out) < n:
        if drafter is None:  # prompt lookup: the k tokens that followed the last match of the last token
            hits = [i for i in range(len(seq) - 1) if seq[i] == seq[-1]]
            start = hits[-1] + 1 if hits else len(seq) - 1
            drafts = (seq[start:start + k] + [seq[-1]] * k)[:k]
        else:  # layer-skip self-draft, sharing the target's cache
            drafts, t, p = [], tok, drafter_pos
            for _ in range(k):
                t = int(drafter.argmax([t], p)[0])
                drafts.append(t)
                p += 1
        ids = runner.argmax([tok] + drafts, pos)
        accepted = 0
        while accepted < k and drafts[accepted] == ids[accepted]:
            accepted += 1
        new = drafts[:accepted] + [int(ids[accepted])]
        out += new
        seq += new
        pos += accepted + 1
        tok = new[-1]
        if drafter is not None:
            drafter_pos = pos
    return out[:n]


@needs_device
def test_speculative_equals_plain_greedy(engines):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner
    runner = TensorRTRunner(engines)
    plain = greedy(runner, PROMPT, 48)
    assert speculative(runner, None, PROMPT, 48, 4) == plain
    skip = runner.layer_skip(engines.graphs.layer_skip_layers)
    assert skip.k_cache.data_ptr() == runner.k_cache.data_ptr()  # the same cache storage
    assert speculative(runner, skip, PROMPT, 48, 4) == plain


@needs_device
def test_runtime_refuses_a_changed_profile(engines):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner
    with pytest.raises(ManifestError, match="graphs.max_context"):
        TensorRTRunner(engines.replace(**{"graphs.max_context": 512}))


def test_scratch_is_shared_and_grows():
    """One context-memory buffer for every context; growing re-binds all and drops CUDA graphs."""
    torch = pytest.importorskip("torch")
    from spec_edge.runtime.backends.tensorrt import Scratch

    class Context:
        def set_device_memory(self, ptr, size):
            self.bound = (ptr, size)

    class OldContext:  # TensorRT 10.0: property only
        device_memory = None

    scratch = Scratch(torch, device="cpu")
    dropped = []
    scratch.on_realloc.append(lambda: dropped.append(1))
    a, b, c = Context(), Context(), OldContext()
    scratch.register(a, 1000)
    scratch.register(b, 500)
    assert a.bound == b.bound == (scratch.buffer.data_ptr(), 1000) and len(dropped) == 1
    scratch.register(c, 4000)
    assert a.bound == b.bound == (scratch.buffer.data_ptr(), 4000) and len(dropped) == 2
    assert c.device_memory == scratch.buffer.data_ptr()

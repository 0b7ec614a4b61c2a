"""TensorRT backend. The first tests run everywhere (the module imports and refuses clearly without
TensorRT); the rest build engines for the embedded SmolLM2 and need `tensorrt` + a CUDA device, and
are skipped with the reason elsewhere."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from spec_edge.config import from_params
from spec_edge.device import builder
from spec_edge.device.manifest import ManifestError
from spec_edge.device.specs import BuildError

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
HEAD = str(Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-eagle3")  # the committed EAGLE-3 head


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
    from spec_edge.runtime.backends import trt_head
    assert hasattr(backend, "TensorRTRunner") and hasattr(backend, "load_runners")
    assert hasattr(trt_head, "TensorRTEagle3Head")


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is installed: the missing-package path cannot be shown")
def test_clear_error_without_tensorrt(tmp_path):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner, load_runners
    cfg = trt_cfg(tmp_path)
    for make in (lambda: TensorRTRunner(cfg), lambda: load_runners(cfg)):
        with pytest.raises(BuildError, match="TensorRT's Python package is not importable"):
            make()


def test_eagle3_and_hybrid_go_to_the_tensorrt_head(tmp_path):
    """On the tensorrt backend eagle3 / hybrid are no longer refused ("onnxruntime backend only"):
    the drafters ask the target for its hidden states and load trt_head.TensorRTEagle3Head. The
    target here is a stand-in (a TensorRT runner cannot exist without CUDA) whose engines return no
    hidden states: its refusal is what must come out, for both drafters; medusa is still refused."""
    from spec_edge.runtime.backends.base import BackendError
    from spec_edge.runtime.drafting import Drafters
    from spec_edge.runtime.requests import RequestError

    class EnginesWithoutHidden:
        vocab_size = 49152

        def hidden_states(self, start, stop):
            raise BackendError("the target engines return no hidden states: set speculative.eagle3_head and rebuild")

    for name in ("eagle3", "hybrid"):
        cfg = trt_cfg(tmp_path, **{"speculative.drafter": name, "speculative.eagle3_head": HEAD})
        drafters = Drafters(cfg, EnginesWithoutHidden(), tokenizer=None, graph_dir=tmp_path, model_cfg=None)
        with pytest.raises(BackendError, match="return no hidden states"):
            drafters.drafter(name)
    cfg = trt_cfg(tmp_path, **{"speculative.medusa_head": HEAD})
    with pytest.raises(RequestError, match="onnxruntime backend only"):
        Drafters(cfg, EnginesWithoutHidden(), None, tmp_path, None).drafter("medusa")


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


def assert_same_but_near_ties(spec: list[int], plain: list[int], reference, prompt: list[int]) -> None:
    """spec == plain token for token, or they part where the float32 reference's top-2 margin is
    below the parity test's 0.05 (fp16 verify [1, k+1] and step [1, 1] round differently, which may
    flip a near tie; past that point the texts legitimately differ). Anything else fails."""
    if spec == plain:
        return
    at = next(i for i, (a, b) in enumerate(zip(spec + [-1], plain + [-2])) if a != b)
    row = reference.prefill(prompt + plain[:at], 0)  # the logits both runs chose token `at` from
    assert margin(row) < 0.05, (f"speculative != plain at token {at} where the float32 reference's top-2 "
                                f"margin is {margin(row):.3f}: more than numerics\nspec  {spec}\nplain {plain}")


@needs_device
def test_speculative_equals_plain_greedy(engines, reference):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner
    runner = TensorRTRunner(engines)
    plain = greedy(runner, PROMPT, 48)
    assert_same_but_near_ties(speculative(runner, None, PROMPT, 48, 4), plain, reference, PROMPT)
    skip = runner.layer_skip(engines.graphs.layer_skip_layers)
    assert skip.k_cache.data_ptr() == runner.k_cache.data_ptr()  # the same cache storage
    assert_same_but_near_ties(speculative(runner, skip, PROMPT, 48, 4), plain, reference, PROMPT)


def test_near_tie_rule_fails_on_a_real_difference():
    """The rule above must be able to fail: a divergence where the reference is sure."""
    class Sure:
        def prefill(self, tokens, position):
            row = np.zeros(8, np.float32)
            row[3] = 5.0  # margin 5
            return row

    class Tied(Sure):
        def prefill(self, tokens, position):
            row = super().prefill(tokens, position)
            row[4] = 4.99  # margin 0.01
            return row

    assert_same_but_near_ties([1, 2, 3], [1, 2, 3], Sure(), [0])
    assert_same_but_near_ties([1, 2, 4, 7], [1, 2, 3, 3], Tied(), [0])
    with pytest.raises(AssertionError, match="token 2 .* margin is 5.000"):
        assert_same_but_near_ties([1, 2, 4], [1, 2, 3], Sure(), [0])


@pytest.fixture(scope="module")
def eagle3_engines(tmp_path_factory):
    """Engines for the embedded default with the committed EAGLE-3 head: target (with hidden
    outputs) + head engine."""
    if not (HAVE_TRT and _cuda()):
        pytest.skip("needs tensorrt and CUDA")
    cfg = trt_cfg(tmp_path_factory.mktemp("trt_eagle3"), **{"speculative.drafter": "eagle3",
                                                             "speculative.eagle3_head": HEAD})
    builder.build(cfg, progress=lambda _m: None)
    return cfg


@needs_device
def test_head_chain_on_the_device_equals_its_steps(eagle3_engines):
    """The TensorRT head's greedy chain (argmax + d2t in the engine, captured step replays fed back
    on the device) drafts what ingest + step with the argmax on the host draft."""
    from spec_edge.runtime.engine import Engine
    engine = Engine.from_config(eagle3_engines, progress=lambda _m: None)
    head, target = engine.drafter("eagle3").head, engine.target
    target.prefill(PROMPT, 0)
    hidden = target.hidden_states(0, len(PROMPT) - 1)
    chain = head.greedy_chain(PROMPT[1:], hidden, 0, 4)
    logits, own = head.ingest(PROMPT[1:], hidden, 0)
    steps = [int(head.draft_ids[int(np.argmax(logits))])]
    for i in range(3):
        logits, own = head.step(steps[-1], own, len(PROMPT) - 1 + i)
        steps.append(int(head.draft_ids[int(np.argmax(logits))]))
    assert chain.tolist() == steps and chain.dtype == np.int64


@needs_device
@pytest.mark.parametrize("drafter", ["eagle3", "hybrid"])
def test_eagle3_and_hybrid_equal_plain_greedy(eagle3_engines, reference, drafter):
    from spec_edge.runtime.engine import Engine
    from spec_edge.runtime.requests import GenerateRequest
    engine = Engine.from_config(eagle3_engines, progress=lambda _m: None)
    request = GenerateRequest(prompt="Rewrite politely: give me the report now.", max_new_tokens=48)
    plain = engine.generate(GenerateRequest(**{**request.__dict__, "drafter": "none"}))
    spec = engine.generate(GenerateRequest(**{**request.__dict__, "drafter": drafter, "k": 4}))
    assert spec.stats.drafted > 0 and spec.stats.verify_calls > 0
    assert_same_but_near_ties(spec.token_ids, plain.token_ids, reference, engine.prompt_ids(request))


@needs_device
def test_runtime_refuses_a_changed_profile(engines):
    from spec_edge.runtime.backends.tensorrt import TensorRTRunner
    with pytest.raises(ManifestError, match="graphs.max_context"):
        TensorRTRunner(engines.replace(**{"graphs.max_context": 512}))


def test_scratch_is_sized_up_front_shared_and_unregistered():
    """One context-memory buffer for every context, sized before any binds (no re-bind); a context
    asking for more than reserved re-binds all and drops CUDA graphs; close() takes contexts out."""
    torch = pytest.importorskip("torch")
    from spec_edge.runtime.backends.tensorrt import Scratch

    class Context:
        def __init__(self):
            self.binds = []

        def set_device_memory(self, ptr, size):
            self.binds.append((ptr, size))

    class OldContext:  # TensorRT 10.0: property only
        device_memory = None

    scratch = Scratch(torch, device="cpu", size=4000)  # load_runners: the manifest's largest
    dropped = []
    scratch.on_realloc.append(lambda: dropped.append(1))
    a, b, c = Context(), Context(), OldContext()
    scratch.register(a, 1000)
    scratch.register(b, 4000)
    assert a.binds == b.binds == [(scratch.buffer.data_ptr(), 4000)] and not dropped  # bound once, full size
    scratch.register(c, 500)
    assert c.device_memory == scratch.buffer.data_ptr()
    scratch.register(b, 8000)  # more than reserved: grows, re-binds everything, drops graphs
    assert a.binds[-1] == (scratch.buffer.data_ptr(), 8000) and len(a.binds) == 2 and dropped == [1]
    scratch.unregister(a)
    scratch.reserve(16000)
    assert len(a.binds) == 2 and b.binds[-1] == (scratch.buffer.data_ptr(), 16000)

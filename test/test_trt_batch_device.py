"""The batched TensorRT runner (graphs.batch_slots = 4) on a device: tensorrt + CUDA, skipped elsewhere with
the reason (scripts/device_check_batch.sh runs these). The embedded SmolLM2 is built in float16 with
`builder.build`; the reference is ONNX Runtime over the float32 batched dynamic file (ort_batch_dynamic.py)
with the same row binding. Near ties are judged as test_tensorrt.py does (the float32 reference's top-2
margin below 0.05). SPEC_EDGE_BATCH_ENGINE_DIR keeps the engines for scripts/measure_batch_trt.py."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from spec_edge.config import from_params
from spec_edge.device import builder
from spec_edge.graphs import batch_dynamic, io_names
from spec_edge.runtime.backends.ort_batch_dynamic import OrtBatchDynamicRunner
from test_tensorrt import HAVE_TRT, PROMPT, _cuda, assert_same_but_near_ties, margin, needs_device

SLOTS, K = 4, 4
PROMPTS = [PROMPT, PROMPT[5:30], PROMPT[:17] + PROMPT[20:40], PROMPT[9:]]


def batch_cfg(engine_dir: str, dtype: str):
    return from_params({"model.target": "embedded", "runtime.backend": "tensorrt", "runtime.engine_dir": engine_dir,
                        "runtime.profile": f"smollm2_trt_b{SLOTS}_{dtype}", "graphs.max_context": 256,
                        "graphs.prefill_chunk": 32, "graphs.k_values": [K], "graphs.dtype": dtype,
                        "graphs.batch_slots": SLOTS, "speculative.drafter": "ngram", "speculative.k": K})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    if not (HAVE_TRT and _cuda()):
        pytest.skip("needs tensorrt and CUDA")
    cfg = batch_cfg(os.environ.get("SPEC_EDGE_BATCH_ENGINE_DIR") or str(tmp_path_factory.mktemp("trt_b4")), "float16")
    builder.build(cfg, progress=lambda _m: None)
    return cfg


@pytest.fixture(scope="module")
def reference(engines):
    cfg = batch_cfg(engines.runtime.engine_dir + "/reference", "float32")
    builder.export_only(cfg, progress=lambda _m: None)
    return OrtBatchDynamicRunner(batch_dynamic.folder(cfg), [1, K + 1])


def runner(engines, **kw):
    from spec_edge.runtime.backends.trt_batch import TensorRTBatchRunner
    return TensorRTBatchRunner(engines, **kw)


def close_rows(got: np.ndarray, want: np.ndarray, what: str) -> None:
    for row_got, row_want in zip(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])):
        assert np.argmax(row_got) == np.argmax(row_want) or margin(row_want) < 0.05, \
            f"{what}: argmax differs where the float32 top-2 margin is {margin(row_want):.3f}"
        assert np.abs(row_got - row_want).max() < 0.25 * np.abs(row_want).max(), what


@needs_device
def test_manifest_and_profiles_carry_the_rows(engines):
    dev = runner(engines)
    entry = dev.manifest["engines"]["target"]
    assert entry["batch"] == SLOTS and entry["rows"] == {"1": [1, 4, 4], "5": [1, 4, 4], "32": [1, 1, 1]}
    for width, profile in entry["profiles"].items():
        low, opt, high = dev.engine.get_tensor_profile_shape(io_names.TOKENS, int(profile))
        assert (tuple(low), tuple(opt), tuple(high)) == tuple((n, int(width)) for n in entry["rows"][width])
    assert dev.k_cache.shape[:2] == (dev.n_layers, SLOTS) and dev.widths == frozenset({1, K + 1})


@needs_device
def test_rows_match_onnxruntime_over_any_subset(engines, reference):
    dev = runner(engines)
    for slot, prompt in enumerate(PROMPTS):
        close_rows(dev.prefill(slot, prompt, 0)[None], reference.prefill(slot, prompt, 0)[None], f"prefill {slot}")
    rng = np.random.default_rng(0)
    for slots in ([0], [3], [1, 2], [3, 0], [0, 1, 2, 3]):
        for width in (1, K + 1):
            tokens = rng.integers(0, dev.vocab_size, (len(slots), width))
            positions = [len(PROMPTS[s]) for s in slots]
            got, want = dev.forward(slots, tokens, positions), reference.forward(slots, tokens, positions)
            close_rows(got, want, f"slots {slots} width {width}")
            assert np.array_equal(dev.argmax(slots, tokens, positions), np.argmax(got, axis=-1))


@needs_device
def test_cuda_graphs_equal_eager_bit_for_bit(engines):
    graphed, eager = runner(engines), runner(engines, cuda_graphs=False)
    rng = np.random.default_rng(1)
    for one in (graphed, eager):
        for slot, prompt in enumerate(PROMPTS):
            one.prefill(slot, prompt, 0)
    for slots in ([0, 1], [0, 1], [2], [0, 1, 2, 3], [0, 1, 2, 3], [1, 3], [1, 3]):  # replays and re-captures
        for width in (1, K + 1):
            tokens = rng.integers(0, graphed.vocab_size, (len(slots), width))
            positions = [len(PROMPTS[s]) for s in slots]
            assert np.array_equal(graphed.argmax(slots, tokens, positions), eager.argmax(slots, tokens, positions))
    assert any(call.graph is not None for call in graphed._calls.values())
    assert np.array_equal(graphed.k_cache.cpu().numpy(), eager.k_cache.cpu().numpy())


@needs_device
def test_a_row_does_not_depend_on_the_other_rows(engines, reference):
    """Slot 0's row alone (n = 1) and in a call of all four slots: printed difference, and the same argmax
    unless the float32 reference is near a tie (the exactness of batched answers rests on this)."""
    dev = runner(engines)
    for slot, prompt in enumerate(PROMPTS):
        dev.prefill(slot, prompt, 0)
        reference.prefill(slot, prompt, 0)
    rng = np.random.default_rng(2)
    for width in (1, K + 1):
        tokens = rng.integers(0, dev.vocab_size, (SLOTS, width))
        positions = [len(p) for p in PROMPTS]
        alone = dev.forward([0], tokens[:1], positions[:1])[0]
        together = dev.forward(list(range(SLOTS)), tokens, positions)[0]
        want = reference.forward([0], tokens[:1], positions[:1])[0]
        print(f"width {width}: slot 0 alone vs in 4 rows, max |diff| {np.abs(alone - together).max():.3g}")
        for row_a, row_t, row_w in zip(alone, together, want):
            assert np.argmax(row_a) == np.argmax(row_t) or margin(row_w) < 0.05


@needs_device
def test_greedy_requests_joining_and_leaving_equal_each_alone(engines, reference):
    """Four requests over the four slots, joining late and leaving early, steps and verifies (prompt lookup
    drafts) in separate calls: each answer == the same request alone in slot 0 on the device (near ties
    judged by the float32 reference)."""
    dev, n_new = runner(engines), 32

    def alone(prompt):
        tok = int(np.argmax(dev.prefill(0, prompt, 0)))
        out, pos = [tok], len(prompt)
        while len(out) < n_new:
            tok = int(dev.argmax([0], [[tok]], [pos])[0, 0])
            out.append(tok)
            pos += 1
        return out

    solo = [alone(p) for p in PROMPTS]
    slots, done, it, join_at = [None] * SLOTS, {}, 0, [0, 2, 3, 9]
    while len(done) < len(PROMPTS):
        for r in (r for r in range(len(PROMPTS)) if join_at[r] == it):
            slot = slots.index(None)
            first = int(np.argmax(dev.prefill(slot, PROMPTS[r], 0)))
            slots[slot] = SimpleNamespace(r=r, seq=PROMPTS[r] + [first], pos=len(PROMPTS[r]), out=[first])
        busy = [s for s in range(SLOTS) if slots[s] is not None]
        drafts = {}
        for s in busy:  # prompt lookup: what followed the last earlier occurrence of the last token
            seq = slots[s].seq
            hits = [i for i in range(len(seq) - 1) if seq[i] == seq[-1]]
            drafts[s] = (seq[hits[-1] + 1:hits[-1] + 1 + K] + [seq[-1]] * K)[:K] if hits and it % 3 else []
        for group in ([s for s in busy if not drafts[s]], [s for s in busy if drafts[s]]):
            if group:
                ids = dev.argmax(group, [[slots[s].seq[-1]] + drafts[s] for s in group], [slots[s].pos for s in group])
                for i, s in enumerate(group):
                    n_ok = next((j for j, d in enumerate(drafts[s]) if d != ids[i, j]), len(drafts[s]))
                    chunk = drafts[s][:n_ok] + [int(ids[i, n_ok])]
                    slots[s].seq, slots[s].pos, slots[s].out = slots[s].seq + chunk, slots[s].pos + len(chunk), \
                        slots[s].out + chunk
        for s in busy:
            if len(slots[s].out) >= n_new or (slots[s].r == 0 and len(slots[s].out) >= 8):
                done[slots[s].r], slots[s] = slots[s].out, None
        it += 1
    ref = SimpleNamespace(prefill=lambda tokens, position: reference.prefill(0, tokens, position))
    for r, out in done.items():
        want = solo[r][:len(out)] if r == 0 else solo[r]
        assert_same_but_near_ties(out[:len(want)], want, ref, PROMPTS[r])

"""The memory planner's byte arithmetic against values computed by hand, and its refusals."""
import dataclasses

import pytest

from spec_edge.config import GraphSection, MemorySection
from spec_edge.device import meminfo, memory, projection
from spec_edge.device.presets import MODEL_PRESETS

LLAMA8 = MODEL_PRESETS["llama-3.1-8b"]
LLAMA1 = MODEL_PRESETS["llama-3.2-1b"]
QWEN06 = MODEL_PRESETS["qwen3-0.6b"]
GIB = 2 ** 30


def test_llama31_8b_weights_by_hand():
    # Llama-3.1-8B: hidden 4096, head_dim 128, 32 q heads, 8 kv heads, inter 14336, 32 layers,
    # vocab 128256, untied.
    # linear per layer = 4096*128*(2*32 + 2*8) + 3*4096*14336 = 41,943,040 + 176,160,768 = 218,103,808
    # norms per layer  = 2*4096 = 8,192
    # bf16 per layer   = (218,103,808 + 8,192) * 2 = 436,224,000;  x32 = 13,959,168,000
    # embed + head + final norm = (2*128256*4096 + 4096) * 2 = 2,101,354,496
    # total = 16,060,522,496  (= n_params 8,030,261,248 x 2: untied, so no extra copy)
    assert memory.weight_bytes(LLAMA8, "bfloat16") == 16_060_522_496
    assert memory.weight_bytes(LLAMA8, "bfloat16") == LLAMA8.n_params * 2
    # fp8: linear 1 byte + 7 linears x 2 fp32 scales (56 bytes), norms stay bf16 (16,384 bytes)
    # per layer = 218,103,808 + 56 + 16,384 = 218,120,248; x32 = 6,979,847,936; + 2,101,354,496
    assert memory.weight_bytes(LLAMA8, "bfloat16", "fp8") == 9_081_202_432
    # nvfp4: 218,103,808/2 = 109,051,904 (4-bit) + 218,103,808/16 = 13,631,488 (FP8 block scales)
    # + 56 + 16,384 = 122,699,832 per layer; x32 = 3,926,394,624; + 2,101,354,496
    assert memory.weight_bytes(LLAMA8, "bfloat16", "nvfp4") == 6_027_749_120
    # layer-skip engine over 8 layers: 8 x 436,224,000 + 2,101,354,496
    assert memory.weight_bytes(LLAMA8, "bfloat16", n_layers=8) == 5_591_146_496
    # KV: 2 (K,V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes per position; 8192 -> 1 GiB
    assert LLAMA8.kv_bytes_per_token(2) == 131_072
    assert memory.kv_bytes(LLAMA8, 8192, "bfloat16") == 1_073_741_824


def test_qwen3_06b_weights_by_hand():
    # Qwen3-0.6B: hidden 1024, head_dim 128, 16 q heads, 8 kv heads, inter 3072, 28 layers,
    # vocab 151936, tied embeddings, qk-norm.
    # linear per layer = 1024*128*(32 + 16) + 3*1024*3072 = 6,291,456 + 9,437,184 = 15,728,640
    # norms per layer  = 2*1024 + 2*128 (q_norm, k_norm) = 2,304
    # bf16 per layer   = (15,728,640 + 2,304) * 2 = 31,461,888;  x28 = 880,932,864
    # tied embedding counted twice (Gather table + head GEMM weight) + final norm:
    #                  (2*151936*1024 + 1024) * 2 = 622,331,904
    # total = 1,503,264,768 = n_params 596,049,920 x 2 + one more table 311,164,928
    assert memory.weight_bytes(QWEN06, "bfloat16") == 1_503_264_768
    assert memory.weight_bytes(QWEN06, "bfloat16") == QWEN06.n_params * 2 + 151936 * 1024 * 2
    assert memory.weight_bytes(QWEN06, "bfloat16", tied_copies=1) == QWEN06.n_params * 2
    # KV: 2 x 28 x 8 x 128 x 2 = 114,688 bytes per position; 4096 positions -> 469,762,048
    assert memory.kv_bytes(QWEN06, 4096, "bfloat16") == 469_762_048
    assert memory.kv_bytes(QWEN06, 4096, "float32") == 2 * 469_762_048


def test_activation_estimate_by_hand():
    # Llama-3.1-8B, S = 8192, T = 5, bf16:
    # dense  = 5 * (2*4096 + (32+2*8)*128 + 32*128 + 3*14336) * 2 = 5 * 61,440 * 2 = 614,400
    # concat = 2 * 8 * (8192+5) * 128 * 2 = 33,574,912
    # scores = 32 * 5 * 8197 * (2+4+2) = 10,492,160
    # head   = 5 * 128256 * 2 = 1,282,560
    assert memory.activation_bytes(LLAMA8, 8192, 5, "bfloat16") == 45_964_032


def graphs(**kw):
    base = dict(max_context=8192, prefill_chunk=128, k_values=(4,), dtype="bfloat16")
    base.update(kw)
    return GraphSection(**base)


def llama_pair_plan(**kw):
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(**kw), memory=MemorySection(),
                               drafter="draft", k=4, draft=LLAMA1)
    return memory.plan(inputs)


def test_llama_pair_plan_by_hand():
    # Llama-3.1-8B + Llama-3.2-1B draft, bf16, S = 8192, C = 128, k = 4, one engine per model:
    #   target weights 16,060,522,496 (above)
    #   draft weights: linear 2048*64*80 + 3*2048*8192 = 60,817,408; (60,817,408 + 4096) * 2 * 16
    #                  = 1,946,288,128; tied table x2 + norm (2*128256*2048 + 2048) * 2 = 1,050,677,248
    #                  -> 2,996,965,376
    #   target KV 1 GiB = 1,073,741,824; draft KV 2*16*8*64*2 * 8192 = 268,435,456
    #   activations: widest call, target at T = 128:
    #     128*61,440*2 + 16*8320*256 + 32*128*8320*8 + 128*128256*2
    #     = 15,728,640 + 34,078,720 + 272,629,760 + 32,833,536 = 355,270,656
    #     (draft at T = 128: 331,153,408, smaller; one shared scratch -> the max)
    #   I/O: target 128*128256*4 + 2*32*8*128*128*2 + 130*8 = 82,445,328
    #        draft  128*128256*4 + 2*16*8*128*64*2  + 130*8 = 69,862,416  -> 152,307,744
    #   workspace 2 GiB, context 1.5 GiB, reserve 12 GiB = 17,179,869,184 together
    #   total = 37,550,241,824 bytes (34.97 GiB)
    p = llama_pair_plan()
    lines = dict(p.lines)
    assert lines["target weights (1 engine)"] == 16_060_522_496
    assert lines["draft weights"] == 2_996_965_376
    assert lines["target KV (8192 positions)"] == 1_073_741_824
    assert lines["draft KV"] == 268_435_456
    assert lines["activations (shared scratch, estimate)"] == 355_270_656
    assert lines["engine I/O buffers (logits, k_new, v_new)"] == 152_307_744
    assert p.total == 37_550_241_824
    # engines are streamed in 64 MiB reads: the start needs the resident bytes plus one read, not
    # plus a whole host copy of the largest engine (16 GB here)
    assert p.load_peak == p.total + 64 * 2**20 and "load peak (engines streamed" in p.table()
    assert p.fits
    # the model's 131072 positions all fit in 128 GiB
    assert p.largest_max_context == 131072


def test_largest_context_is_the_boundary():
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(), drafter="draft", k=4, draft=LLAMA1,
                               memory=MemorySection(device_memory_gb=40.0))
    p = memory.plan(inputs)
    s = p.largest_max_context
    assert 8192 < s < 131072 and s % memory.CONTEXT_STEP == 0
    at = memory.plan(dataclasses.replace(inputs, graphs=graphs(max_context=s)))
    above = memory.plan(dataclasses.replace(inputs, graphs=graphs(max_context=s + memory.CONTEXT_STEP)))
    assert at.total <= at.device < above.total


def test_per_graph_layout_counts_each_engine():
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(), memory=MemorySection(), drafter="draft",
                               k=4, draft=LLAMA1, layout="per_graph")
    lines = dict(memory.plan(inputs).lines)
    # prefill 128, step 1, verify 5: three copies; draft prefill + step: two
    assert lines["target weights (3 engines)"] == 3 * 16_060_522_496
    assert lines["draft weights"] == 2 * 2_996_965_376


def test_layer_skip_counts_its_engine_not_kv():
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(layer_skip_layers=8), memory=MemorySection(),
                               drafter="layerskip", k=1)
    lines = dict(memory.plan(inputs).lines)
    assert lines["layer-skip engine weights (8 layers + head)"] == 5_591_146_496
    assert lines["draft KV (shares target layers)"] == 0


def test_refusal_names_the_numbers():
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(max_context=131072), drafter="draft", k=4,
                               draft=LLAMA1, memory=MemorySection(device_memory_gb=48.0))
    p = memory.plan(inputs)
    assert not p.fits
    with pytest.raises(memory.PlanError) as err:
        memory.check(p)
    text = str(err.value)
    assert "does not fit" in text and "GiB" in text
    assert f"graphs.max_context <= {p.largest_max_context}" in text
    assert "target weights" in text and "OS + ROS reserve" in text
    assert "graphs.weights: int4_awq, fp8 or nvfp4" in text


def test_refusal_when_the_device_has_less_free_now():
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(), drafter="draft", k=4, draft=LLAMA1,
                               memory=MemorySection())
    device = memory.DeviceMemory(total=122 * GIB, available=10 * GIB, source="test")
    p = memory.plan(inputs, device)
    assert p.device == 122 * GIB and p.device_source == "test"
    with pytest.raises(memory.PlanError, match="free now"):
        memory.check(p)
    roomy = memory.plan(inputs, memory.DeviceMemory(total=122 * GIB, available=100 * GIB, source="test"))
    assert memory.check(roomy) is roomy


def test_build_peak_refused():
    # 18 GiB device: the runtime plan of a small context might squeeze, building the 8B cannot
    inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(max_context=256, prefill_chunk=16),
                               drafter="none", k=4, memory=MemorySection(device_memory_gb=36.0,
                                                                         os_ros_reserve_gb=2.0))
    p = memory.plan(inputs)
    assert p.total <= p.device < p.build_peak
    with pytest.raises(memory.PlanError, match="building the largest engine"):
        memory.check(p)


def test_parse_meminfo():
    text = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   120000000 kB\n"
    assert meminfo.parse_meminfo(text) == (131072000 * 1024, 120000000 * 1024)
    with pytest.raises(ValueError):
        meminfo.parse_meminfo("MemTotal: 1 kB\n")


def test_expected_tokens_and_best_k():
    # alpha = 0.75, k = 4: (1 - 0.75**5) / 0.25 = (1 - 0.2373046875) / 0.25 = 3.05078125
    assert projection.expected_tokens(0.75, 4) == pytest.approx(3.05078125)
    assert projection.expected_tokens(1.0, 4) == 5.0
    # free drafts (ngram): more is never worse at alpha < 1 under this model
    assert projection.best_k(0.6, 0.0, 8) == 8
    # expensive drafts: k = 1
    assert projection.best_k(0.4, 0.3, 8) == 1


def test_batch_slots_count_kv_activations_and_io():
    """graphs.batch_slots = B: B cache regions (the draft model's too); the target's decode calls run up to B rows,
    its prefill chunk one (memory.target_rows), so activations and I/O are the larger of the two; weights once."""
    def plan_lines(batch_slots):
        inputs = memory.PlanInputs(target=LLAMA8, graphs=graphs(batch_slots=batch_slots), memory=MemorySection(),
                                   drafter="draft", k=4, draft=LLAMA1)
        return dict(memory.plan(inputs).lines)

    one, four = plan_lines(1), plan_lines(4)
    kv = one["target KV (8192 positions)"]
    assert kv == memory.kv_bytes(LLAMA8, 8192, "bfloat16") and four["target KV (4 x 8192 positions)"] == 4 * kv
    assert four["draft KV"] == 4 * one["draft KV"]
    draft_io = memory.io_bytes(LLAMA1, 128, "bfloat16")  # the draft model's B rows at its widest (prefill) width
    assert one["engine I/O buffers (logits, k_new, v_new)"] == memory.io_bytes(LLAMA8, 128, "bfloat16") + draft_io
    assert four["engine I/O buffers (logits, k_new, v_new)"] == max(
        4 * memory.io_bytes(LLAMA8, 5, "bfloat16"), memory.io_bytes(LLAMA8, 128, "bfloat16")) + 4 * draft_io
    assert memory.target_rows(graphs(batch_slots=4)) == {1: (1, 4, 4), 5: (1, 4, 4), 128: (1, 1, 1)}
    assert four["target weights (1 engine)"] == one["target weights (1 engine)"]

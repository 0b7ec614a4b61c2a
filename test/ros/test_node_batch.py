"""In-flight batching through the node (graphs.batch_slots > 1) with real rclpy processes on loopback:
8 client processes at once over 4 slots, none lost, each answer == the same request alone; the chat
prefix warmed into every slot (serve.warm_system_prompt) is reused by every request."""
from __future__ import annotations

import time

import pytest

from rosutil import engine_request, finish_client, start_client
from spec_edge.runtime.scheduler import run_one

PROMPTS = [f"Robot {name} moves the {thing} to the {place}. Robot {name} moves the"
           for name, thing, place in (("A", "box", "door"), ("B", "cup", "kitchen"), ("C", "arm", "window"),
                                      ("D", "tray", "table"), ("E", "tool", "lab"), ("F", "cart", "dock"),
                                      ("G", "bin", "shelf"), ("H", "lamp", "hall"))]
MAX_NEW = [60, 20, 40, 75, 30, 50, 16, 70]  # each prompt is 53 tokens: at most 75 fit the 128-token context


@pytest.fixture(scope="module")
def batch_params(tiny_models):
    # the batched folder of test_batch.py's batch_cfg (same engine dir, profile, shape): exported once a session
    return {"model.target": str(tiny_models["target"]), "graphs.max_context": 128, "graphs.prefill_chunk": 16,
            "graphs.k_values": [3], "graphs.layer_skip_layers": 2, "graphs.batch_slots": 4, "graphs.weights": "fp32",
            "runtime.engine_dir": str(tiny_models["root"] / "engines"), "runtime.profile": "tiny",
            "speculative.drafter": "ngram", "speculative.k": 3, "serve.queue_limit": 8,
            "serve.warm_system_prompt": True,
            # written into the params file as a benchmark's config.dump writes it: rclpy reads an empty
            # list as an unset parameter (None), which the node must take as the empty table
            "serve.speculate_k_by_load": []}


@pytest.fixture(scope="module")
def solo(batch_params):
    """Each request alone and cold (no prefix reuse) through the same batched graphs, in this process
    (exports them first)."""
    from spec_edge import artifacts
    from spec_edge import config as cfgmod

    cold = {**batch_params, "serve.reuse_prefix": False, "serve.warm_system_prompt": False}
    engine = artifacts.engine(cfgmod.from_params(cold), progress=lambda m: None)
    yield [run_one(engine, engine_request(prompt=p, max_new_tokens=n)) for p, n in zip(PROMPTS, MAX_NEW)]
    engine.close()


def test_eight_clients_each_get_their_solo_answer(server_factory, batch_params, solo, module_env):
    server = server_factory(batch_params)
    start_at = time.time() + 12  # every client process up and connected, then all send at once
    clients = [start_client(module_env, {"mode": "call", "start_at": start_at,
                                         "requests": [{"prompt": p, "max_new_tokens": n}]})
               for p, n in zip(PROMPTS, MAX_NEW)]
    answers = [finish_client(c)[0] for c in clients]
    for prompt, answer, want in zip(PROMPTS, answers, solo):
        assert answer["success"], answer
        # a ROS string ends at a NUL byte, which the random tiny model writes now and then; the same
        # drafted / accepted counts also say the answer's tokens went the same way
        assert (answer["text"], answer["num_tokens"], answer["finish_reason"]) == \
            (want.text.split("\x00")[0], len(want.token_ids), want.finish_reason), prompt
        assert (answer["stats"]["drafted"], answer["stats"]["accepted"]) == (want.stats.drafted, want.stats.accepted)
    assert sum(a["stats"]["drafted"] for a in answers) > 0  # prompt lookup did speculate
    # the slots were shared: all four in use (the load counts the occupied slots + the queue behind them)
    assert max(a["stats"]["queued_at_start"] for a in answers) >= 4
    assert "warmed the cache with the system prompt" in server.log()
    assert min(a["stats"]["prompt_tokens_reused"] for a in answers) > 0  # each slot held the chat prefix
    status, = finish_client(start_client(module_env, {"mode": "diagnostics"}))
    assert status["values"]["batch_slots"] == "4" and int(status["values"]["served"]) == len(PROMPTS)


def test_batched_engine_serves_guided_requests(batch_params, solo):
    """Guided decoding runs in the slot loop (one grammar state per slot): a regex request completes its
    grammar, and the next plain request is still its solo answer."""
    import re

    from spec_edge import artifacts
    from spec_edge import config as cfgmod

    action = r"(pick|place|move) the (red|blue|green) (box|cup|arm)\."
    engine = artifacts.engine(cfgmod.from_params(batch_params), progress=lambda m: None)
    try:
        guided = run_one(engine, engine_request(prompt=PROMPTS[0], regex=action, max_new_tokens=40))
        assert guided.finish_reason == "eos" and re.fullmatch(action, guided.text), guided
        assert run_one(engine, engine_request(prompt=PROMPTS[0], max_new_tokens=MAX_NEW[0])).token_ids == \
            solo[0].token_ids
    finally:
        engine.close()

"""The node with http.enabled: the HTTP door and the ROS interfaces serve from one scheduler on the default profile
(q4, 4 slots, k auto). 8 HTTP streams and 4 ROS calls at once each get the answer the same request got alone (greedy:
the same text whatever k the load gives it), and none is lost."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from rosutil import REPO, finish_client, start_client

pytestmark = pytest.mark.real_model("default")

PROMPTS = [f"Robot {name} moves the {thing} to the {place}. Repeat that sentence twice."
           for name, thing, place in (("A", "box", "door"), ("B", "cup", "kitchen"), ("C", "arm", "window"),
                                      ("D", "tray", "table"), ("E", "tool", "lab"), ("F", "cart", "dock"),
                                      ("G", "bin", "shelf"), ("H", "lamp", "hall"), ("I", "key", "desk"),
                                      ("J", "pen", "floor"), ("K", "map", "wall"), ("L", "fan", "roof"))]
MAX_NEW = [24, 40, 32, 16, 36, 28, 20, 40, 30, 24, 34, 18]
KEY = "ros-test-key"


@pytest.fixture(scope="module")
def door_url(server_factory):
    with socket.socket() as probe:  # a free port on loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server_factory({"runtime.engine_dir": str(REPO / "engines"), "http.enabled": True, "http.port": port,
                    "http.api_key": KEY})  # otherwise the default profile
    return f"http://127.0.0.1:{port}/v1"


def stream(base: str, prompt: str, max_new: int) -> str:
    import openai

    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=300)
    chunks = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_new, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def test_http_streams_and_ros_calls_at_once(door_url, module_env):
    import httpx

    assert httpx.get(door_url[:-3] + "/health").json()["status"] == "ok"
    alone = [stream(door_url, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    start_at = time.time() + 10  # the ROS client processes up and connected, then everyone sends at once
    ros = [start_client(module_env, {"mode": "call", "start_at": start_at,
                                     "requests": [{"prompt": p, "max_new_tokens": n}]})
           for p, n in zip(PROMPTS[8:], MAX_NEW[8:])]
    http: dict[int, str] = {}

    def one(i: int) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        http[i] = stream(door_url, PROMPTS[i], MAX_NEW[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    answers = [finish_client(c)[0] for c in ros]
    for thread in threads:
        thread.join(300)
    assert sorted(http) == list(range(8)), "an HTTP stream got no answer"
    assert [http[i] for i in range(8)] == alone[:8]
    assert all(a["success"] for a in answers), answers
    assert [a["text"] for a in answers] == alone[8:]  # the ROS door: the HTTP door's answer alone
    assert max(a["stats"]["queued_at_start"] for a in answers) >= 4  # the slots were shared


def test_a_reachable_address_without_a_key_fails_configure(server_factory):
    """Refused at configure, before the engine loads, with the setting to change."""
    with pytest.raises(RuntimeError, match="http.api_key is empty"):
        server_factory({"http.enabled": True, "http.host": "0.0.0.0", "http.port": 0}, name="open")

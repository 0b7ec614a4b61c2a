"""The cost of the hop: the same greedy chat requests to an OpenAI-compatible server called directly (the openai
client, streamed), through runtime.backend remote in this process (the scheduler's run_one, what `spec-edge
generate` runs) and, with --door, through a `spec-edge http` door whose profile is runtime.backend remote (the
node's path: its front, queue and scheduler, then the remote), in rotated order, every answer checked equal to the
direct one; TTFT, total time and decode tokens/s, medians side by side (docs/remote.md, docs/bench.md).

    spec-edge http --port 8000 &        # or any server remote.kind names (llama.cpp's: docs/bench.md)
    spec-edge http --config REMOTE_PROFILE.yaml --port 8001 &     # optional: the door in front of it
    PYTHONPATH=$PWD .venv/bin/python bench/remote_hop.py REMOTE_PROFILE.yaml [--runs 5] [--door http://127.0.0.1:8001/v1]

REMOTE_PROFILE: runtime.backend remote with remote.base_url / remote.model / remote.kind (docs/remote.md)."""
import argparse
import statistics
import time

import openai

from spec_edge import config as cfgmod
from spec_edge.runtime.decoders import open_decoder
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one

PROMPTS = ("List three colours of the rainbow and say one thing about each.",
           "Tell the robot how to carry a cup of tea to the kitchen, in two sentences.")
MAX_NEW = 48


def openai_stream(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, float, float, int]:
    """(text, ttft s, total s, completion tokens) of one streamed greedy chat request."""
    t0, first, text, usage, pieces = time.monotonic(), None, "", 0, 0
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=MAX_NEW, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage.completion_tokens if chunk.usage else usage
        for c in chunk.choices:
            if c.delta.content:
                first = first or time.monotonic() - t0
                text += c.delta.content
                pieces += 1
    # a server that sends no usage in a stream (llama-cpp-python 0.3.36): one piece per token, as it streams
    return text, first, time.monotonic() - t0, usage or pieces


def through_decoder(dec, prompt: str) -> tuple[str, float, float, int]:
    t0, firsts = time.monotonic(), []
    r = run_one(dec, GenerateRequest(messages=(("user", prompt),), max_new_tokens=MAX_NEW, temperature=0),
                on_text=lambda d, k: firsts.append(time.monotonic() - t0))
    assert r.stats.served_by == "remote", r.stats.served_by
    return r.text, firsts[0], time.monotonic() - t0, r.stats.new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--door", help="a `spec-edge http` door (runtime.backend remote) in front of the server")
    args = parser.parse_args()
    cfg = cfgmod.load(args.profile)
    dec = open_decoder(cfg, progress=print)
    direct = openai.OpenAI(base_url=cfg.remote.base_url, api_key=cfg.remote.api_key or "none", max_retries=0)
    ways = {"direct": lambda p: openai_stream(direct, cfg.remote.model, p),
            "remote decoder": lambda p: through_decoder(dec, p)}
    if args.door:
        door = openai.OpenAI(base_url=args.door, api_key="none", max_retries=0)
        door_model = door.models.list().data[0].id
        ways["http door -> remote"] = lambda p: openai_stream(door, door_model, p)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
    for prompt in PROMPTS:  # each way once unmeasured (the server's and the door's first request)
        for run in ways.values():
            run(prompt)
    names = list(ways)
    for i in range(args.runs):
        for j, prompt in enumerate(PROMPTS):
            answers = {}
            # rotated: each way goes first as often (a server that keeps the last prompt's cache, as llama.cpp's
            # does, answers the same prompt again without its prefill)
            turn = (i * len(PROMPTS) + j) % len(names)
            for name in names[turn:] + names[:turn]:
                run = ways[name]
                text, ttft, total, tokens = run(prompt)
                answers[name] = text
                times[name].append((ttft, total, (tokens - 1) / max(total - ttft, 1e-9)))
            assert len(set(answers.values())) == 1, answers
        print(f"run {i}: " + " | ".join(f"{name} ttft {t[-1][0]:.3f} s total {t[-1][1]:.3f} s {t[-1][2]:.1f} tok/s"
                                         for name, t in times.items()), flush=True)
    n = args.runs * len(PROMPTS)
    print(f"\nmedian of {n} ({args.runs} runs x {len(PROMPTS)} prompts, {MAX_NEW} new tokens, every answer the same "
          f"text every way), {cfg.remote.kind} server {cfg.remote.base_url}:")
    print("| | TTFT | total | decode tok/s | total / direct |\n|---|---|---|---|---|")
    base = statistics.median(t[1] for t in times["direct"])
    for name, t in times.items():
        med = [statistics.median(x[j] for x in t) for j in range(3)]
        print(f"| {name} | {med[0]:.3f} s | {med[1]:.3f} s | {med[2]:.1f} | x{med[1] / base:.3f} |")
    dec.close()


if __name__ == "__main__":
    main()

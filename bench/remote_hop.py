"""The cost of the hop: the same greedy chat request to an OpenAI-compatible server called directly (the openai
client, streamed) and through runtime.backend remote (the scheduler's run_one, what `spec-edge generate` runs),
alternated, the answers checked equal; TTFT and total time, medians side by side (docs/remote.md).

    spec-edge http --port 8000 &        # or any server remote.kind names
    PYTHONPATH=$PWD .venv/bin/python bench/remote_hop.py REMOTE_PROFILE.yaml [RUNS]

REMOTE_PROFILE: runtime.backend remote with remote.base_url / remote.model (docs/remote.md)."""
import sys, time, statistics, openai
from spec_edge import config as cfgmod
from spec_edge.runtime.decoders import open_decoder
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
cfg = cfgmod.load(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 5
dec = open_decoder(cfg, progress=print)
client = openai.OpenAI(base_url=cfg.remote.base_url, api_key="none", max_retries=0)
prompt = "List three colours of the rainbow and say one thing about each."
direct, hop = [], []
for i in range(n):
    t0 = time.monotonic(); first = None; text = ""
    for chunk in client.chat.completions.create(model=cfg.remote.model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=48, temperature=0, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                first = first or time.monotonic() - t0; text += c.delta.content
    direct.append((first, time.monotonic() - t0))
    t0 = time.monotonic(); firsts = []
    r = run_one(dec, GenerateRequest(messages=(("user", prompt),), max_new_tokens=48, temperature=0),
                on_text=lambda d, k: firsts.append(time.monotonic() - t0))
    hop.append((firsts[0], time.monotonic() - t0))
    assert r.text == text, (r.text, text)
    print(f"run {i}: direct ttft {direct[-1][0]:.3f} s total {direct[-1][1]:.3f} s | remote ttft {hop[-1][0]:.3f} s total {hop[-1][1]:.3f} s | served_by {r.stats.served_by} same text {r.text == text}")
md = lambda xs, j: statistics.median(x[j] for x in xs)
print(f"median over {n}: TTFT direct {md(direct,0):.3f} s, through remote {md(hop,0):.3f} s (+{md(hop,0)-md(direct,0):.3f} s); total direct {md(direct,1):.3f} s, remote {md(hop,1):.3f} s (ratio {md(hop,1)/md(direct,1):.3f})")
dec.close()

"""The door's /metrics: Prometheus text exposition format 0.0.4, written by hand (no client library): requests by
outcome, tokens, speculation (drafted / accepted), the scheduler's queue, and histograms of time to first token and
decode tokens/s of the requests this door served."""
from __future__ import annotations

import bisect
import threading
from collections import Counter

TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TPS_BUCKETS = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # [i]: observations in (buckets[i-1], buckets[i]]; last: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, seen = [], 0
        for le, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            seen += count
            out.append(f'{name}_bucket{{le="{le}"}} {seen}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {seen}"]


class Metrics:
    """Counters the door updates per request (any thread) and renders on GET /metrics."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # outcome -> requests
        self.tokens = Counter()                   # prompt / completion -> tokens
        self.drafted = self.accepted = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tps = Histogram(TPS_BUCKETS)

    def count(self, outcome: str, stats: dict | None = None, completion_tokens: int = 0) -> None:
        """outcome, one per HTTP request the door answered or lost: success | cancelled (the server stopped it) |
        invalid (a bad body or request: 400) | too_large (413) | unauthorized (401) | not_found (404) | busy (429) |
        unavailable (503) | error (500) | disconnected (the client went away before its answer)"""
        with self._lock:
            self.requests[outcome] += 1
            if not stats:
                return
            self.tokens["prompt"] += int(stats.get("prompt_tokens", 0))
            self.tokens["completion"] += completion_tokens
            self.drafted += int(stats.get("drafted", 0))
            self.accepted += int(stats.get("accepted", 0))
            if completion_tokens:
                self.ttft.observe(float(stats.get("time_to_first_token_s", 0.0)))
            if completion_tokens > 1:
                self.tps.observe(float(stats.get("tokens_per_s", 0.0)))

    def render(self, queue_depth: int, in_flight: int, capacity: int, suffix: dict | None = None,
               remote: dict | None = None, images: dict | None = None) -> str:
        def block(name: str, kind: str, about: str, lines: list[str]) -> list[str]:
            return [f"# HELP {name} {about}", f"# TYPE {name} {kind}", *lines]

        with self._lock:
            out = block("spec_edge_http_requests_total", "counter", "HTTP requests by outcome (every refusal, and clients gone before their answer)",
                        [f'spec_edge_http_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())])
            out += block("spec_edge_tokens_total", "counter", "tokens of the requests this door served",
                         [f'spec_edge_tokens_total{{kind="{k}"}} {self.tokens[k]}' for k in ("prompt", "completion")])
            out += block("spec_edge_draft_tokens_total", "counter", "draft tokens sent to verify, and accepted",
                         [f'spec_edge_draft_tokens_total{{result="drafted"}} {self.drafted}',
                          f'spec_edge_draft_tokens_total{{result="accepted"}} {self.accepted}'])
            out += block("spec_edge_acceptance_ratio", "gauge", "accepted / drafted over this door's requests",
                         [f"spec_edge_acceptance_ratio {self.accepted / self.drafted if self.drafted else 0.0}"])
            out += block("spec_edge_queue_depth", "gauge", "requests waiting for a slot (every door)",
                         [f"spec_edge_queue_depth {queue_depth}"])
            out += block("spec_edge_http_in_flight", "gauge", "HTTP requests submitted and not answered yet",
                         [f"spec_edge_http_in_flight {in_flight}"])
            out += block("spec_edge_slots", "gauge", "requests the engine runs at once", [f"spec_edge_slots {capacity}"])
            out += block("spec_edge_time_to_first_token_seconds", "histogram", "time to first token",
                         self.ttft.lines("spec_edge_time_to_first_token_seconds"))
            out += block("spec_edge_decode_tokens_per_second", "histogram", "decode speed after the first token",
                         self.tps.lines("spec_edge_decode_tokens_per_second"))
            if suffix:  # the engine's SuffixStore.memory()
                out += block("spec_edge_suffix_store", "gauge", "the suffix drafter's store of past answers",
                             [f'spec_edge_suffix_store{{kind="{k}"}} {v}' for k, v in sorted(suffix.items())])
            if remote:  # runtime.backend remote: its link's state (runtime/backends/remote_link.Link.state)
                out += block("spec_edge_remote_up", "gauge", "1 while the circuit to the remote server is closed",
                             [f'spec_edge_remote_up {int(remote["up"])}'])
                out += block("spec_edge_remote_errors_total", "counter", "link failures to the remote server",
                             [f'spec_edge_remote_errors_total {remote["errors"]}'])
                out += block("spec_edge_remote_first_token_seconds", "gauge", "the last remote request's time to "
                             "its first piece", [f'spec_edge_remote_first_token_seconds {remote["first_token_s"]}'])
            if images:  # a vision target's encoder-output cache (runtime/image_encoder.ImageEncoder.info)
                out += block("spec_edge_image_cache_entries", "gauge", "images whose encoder output is kept",
                             [f'spec_edge_image_cache_entries {images["cache_entries"]}'])
                out += block("spec_edge_image_cache_total", "counter", "images looked up in the encoder-output cache",
                             [f'spec_edge_image_cache_total{{result="hit"}} {images["cache_hits"]}',
                              f'spec_edge_image_cache_total{{result="miss"}} {images["cache_misses"]}'])
        return "\n".join(out) + "\n"

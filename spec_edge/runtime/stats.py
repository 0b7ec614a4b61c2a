"""Stats: what one request's decoding did (counts, times, acceptance by draft position), as the loop
(runtime/speculative.py) and the Edge-LLM adapter fill it and every door reports it."""
from __future__ import annotations

from dataclasses import dataclass, field

from spec_edge.runtime.sampling import TokenLogprobs


@dataclass
class Stats:
    drafter: str = "none"
    served_by: str = ""            # runtime.backend remote: "remote", or "local" (its fallback answered)
    k: int = 0
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0  # prompt rows kept from the previous request (not prefilled)
    new_tokens: int = 0
    drafted: int = 0               # draft tokens sent to verify
    accepted: int = 0              # of those, accepted
    forced: int = 0                # guided: draft tokens the grammar forced (no drafter asked)
    cut: int = 0                   # guided: draft tokens dropped before verify (the grammar forbids them)
    verify_calls: int = 0
    step_calls: int = 0            # plain [1, 1] target steps (no proposal, or no room)
    accepted_at: list[int] = field(default_factory=list)  # [i]: verifies whose draft i+1 was accepted (len k)
    # [i]: verify calls that could carry i+1 drafts (the k the load policy chose for the call; len k)
    verify_calls_by_k: list[int] = field(default_factory=list)
    policy_off_steps: int = 0      # plain steps where the load policy (Edge-LLM) chose k = 0 (in step_calls)
    auto_off_steps: int = 0        # speculative.k auto: plain steps where k = 0 was expected fastest (in step_calls)
    prefill_time_s: float = 0.0
    target_time_s: float = 0.0     # verify + step calls (prefill excluded)
    draft_time_s: float = 0.0
    total_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    # per emitted token (sampling.logprobs > 0): its log-probability and its row's top N; not in as_dict
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify call (accepted drafts + the target's own token)."""
        return (self.accepted + self.verify_calls) / self.verify_calls if self.verify_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens after the first over the time after the first token."""
        decode = self.total_time_s - self.time_to_first_token_s
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """[i]: the share of the verify calls that could carry draft i+1 (k >= i+1) that accepted it."""
        reach = [sum(self.verify_calls_by_k[i:]) for i in range(len(self.accepted_at))]
        return [n / calls if calls else 0.0 for n, calls in zip(self.accepted_at, reach)] if self.verify_calls else []

    def verified(self, k: int, drafted: int, accepted: int) -> None:
        """Count one verify call that could carry k drafts, carried `drafted` and accepted `accepted`."""
        self.verify_calls += 1
        self.verify_calls_by_k[k - 1] += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "logprobs"}
        for name in ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "acceptance_per_position"):
            out[name] = getattr(self, name)
        return out

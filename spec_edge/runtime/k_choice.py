"""speculative.k: auto, the one way k is chosen on ONNX Runtime: each request's k (0 included) at every iteration
of the loop from its own live acceptance and the runner's measured call costs, so a drafter that is not repaid
is not run. The rules and the measurements behind them: docs/bench.md, "`speculative.k: auto`, measured".

  CallCosts   ms of one target call by (rows, width): measured once as the engine loads (measure_costs: every
              row count 1..B at every width, interleaved rounds, the fastest of each; the one cost
              measurement, which `spec-edge bench` prints too), then moved by every call the loop makes (the
              load level per row count by FRESH, the width's base by RATIO).
  KChoice     one request's choice. Per draft position i two decayed estimates a_i of P(draft i accepted |
              drafts 1..i-1 were): this stretch of text's (WEIGHT per verify) and the drafter's long run (SLOW,
              carried across requests by KChoice.after); and the ms of drafting per draft token. At n decoding
              slots it expects, per iteration,

                  tokens(k) = 1 + a_1 + a_1 a_2 + ... + a_1 .. a_k      ms(k) = c(n, k+1) + k d
                  rate(k)   = tokens(k) / ms(k)                        rate(0) = 1 / c(n, step width)

              over k in {0} + the verify widths its drafter can propose. The best k > 0 runs at every iteration
              (switching between k > 0 costs nothing); speculation stops once neither estimate beats plain by
              KEEP, or this stretch's has said stop DOUBT verifies more than it said go on; at k = 0 only a
              probe (one verify at the smallest k) with a draft accepted restarts it, when it beats plain by
              MARGIN. Probes back off: the first once it costs at most PROBE_SHARE of the plain steps since the
              stop (at least PROBE_GAP), each probe with a rejected draft doubles the gap up to its measured
              extra cost over a step / PROBE_BUDGET (at most PROBE_GAP_MAX): a hopeless drafter costs about
              PROBE_BUDGET of a step per iteration.

Greedy output is the same token for token whatever k runs, and sampled output keeps the target's
distribution at every k (runtime/sampling.speculative_accept): the choice changes speed only. Pure
arithmetic on numbers the loop hands in, but measure_costs, which runs the runner's own calls.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

Costs = dict[tuple[int, int], float]  # (rows j, width w) -> ms of one call

WEIGHT = 0.25        # weight of one verify's outcome in a position's acceptance estimate (this stretch of text;
                     # 1/n for the drafter's first n verifies)
SLOW = 0.03          # its weight in the long-run estimate (the drafter's, across requests; 1/n for the first)
DOUBT = 16           # the long run keeps speculation going until this stretch has said stop this many verifies
                     # more than it said go on
RELAX = 0.05         # per plain step, the stretch's estimate moves this far toward the long-run one
PRIOR = 0.5          # a position's acceptance before its first outcome
MARGIN = 0.08        # speculation starts (after a probe) only when its rate is 8 % above plain decoding's
KEEP = 0.05          # speculation goes on while its rate is at least 5 % above plain decoding's
PROBE_BUDGET = 0.01  # a probe's extra cost over a step, spread over the plain steps between probes: 1 % of a step
PROBE_SHARE = 0.125  # the first probe after a stop: its extra cost over a step, over the plain steps before it
PROBE_GAP = 4        # the first probe after a stop is at least this far; each probe that fails doubles the gap
PROBE_GAP_MAX = 128  # the budget gap is at most this many iterations
FRESH = 0.1          # weight of one live call's time in its row count's level
RATIO = 0.03         # weight of one live call's time (over that level) in its width's base cost


# ---------------------------------------------------------------------------------------------
# Call costs


def verify_cost(costs: dict[int, float], k: int) -> float:
    """c_verify(k) from measured widths; between or beyond them a least-squares line in k."""
    if k in costs:
        return costs[k]
    ks = sorted(costs)
    if len(ks) == 1:
        return costs[ks[0]]
    slope, intercept = np.polyfit(ks, [costs[x] for x in ks], 1)
    return float(intercept + slope * k)


def forward_call(runner, position: int = 128) -> Callable[[int, int], object]:
    """call(j, width) on a slotted runner (ort_runner.OrtRunner): greedy ids of slots 0..j-1, every slot's
    cache prefilled to position (what the slots' regions held is forgotten: runner.held emptied)."""
    batch = runner.batch
    position = min(position, runner.max_context - max(runner.widths) - 1)
    runner.held = [()] * batch  # the calls below rewrite every region
    for slot in range(batch):
        runner.prefill(slot, list(range(10, 10 + position)), 0)
    tokens = {width: np.full((batch, width), 11, np.int64) for width in runner.widths}

    def call(rows: int, width: int):
        return runner.argmax(list(range(rows)), tokens[width][:rows], [position] * rows)
    return call


@dataclass
class CallCosts:
    """ms of one target call by (rows, width) = its base cost x the live level at that row count. The base
    costs are measured together, interleaved (measure_costs), so their ratios (what a verify costs in steps)
    hold; every live call moves its row count's level (the machine's load now) by FRESH toward its own
    time over its base, so a width the choice stopped using is never left at a stale price, and moves its
    own width's base by RATIO toward its time over the level, so ratios measured on a busy machine are
    corrected by the calls the loop makes."""
    ms: Costs = field(default_factory=dict)            # (rows, width) -> base ms
    level: dict[int, float] = field(default_factory=dict)  # rows -> live ms / base ms (1 until a live call)

    def observe(self, rows: int, width: int, ms: float) -> None:
        """A live call's time. A width without a base takes it (at the current level); otherwise the level
        moves by FRESH toward ms / base, then the base by RATIO toward ms / level, one call counting at most
        3x or a third of either (a call the OS descheduled)."""
        level = self.level.get(rows, 1.0)
        base = self.ms.get((rows, width))
        if base is None:
            self.ms[(rows, width)] = ms / level
            return
        self.level[rows] = level = level + FRESH * (min(max(ms / base, level / 3), 3 * level) - level)
        self.ms[(rows, width)] = base + RATIO * (min(max(ms / level, base / 3), 3 * base) - base)

    def cost(self, rows: int, width: int, step_width: int) -> float | None:
        """ms of a call of rows x width, never less than the step's (more tokens cost no less: a timing below
        it is noise): measured, else a line through the measured widths at these rows, else the step's cost
        (a width never timed is tried as if it cost a step: its first live call sets it); None when the
        step at these rows was never timed."""
        step = self.ms.get((rows, step_width))
        if step is None:
            return None
        if (rows, width) in self.ms:
            base = max(self.ms[(rows, width)], step)
        else:
            at_rows = {w: ms for (j, w), ms in self.ms.items() if j == rows}
            base = max(verify_cost(at_rows, width), step) if len(at_rows) >= 2 else step
        return base * self.level.get(rows, 1.0)


def measure_costs(runner, rounds: int = 7) -> CallCosts:
    """The costs of every row count 1..runner.batch at every width the runner has (step and verify), each
    the fastest of `rounds` interleaved calls after a warm-up (not the median, which a busy machine flattens:
    docs/bench.md): the live level follows the load, the ratios between widths start as measured here.
    Forgets what the slots' regions held (forward_call)."""
    call = forward_call(runner)
    keys = [(rows, width) for rows in range(1, runner.batch + 1) for width in sorted(runner.widths)]
    times: dict[tuple[int, int], list[float]] = {key: [] for key in keys}
    for key in keys:  # warm-up
        call(*key)
    for r in range(rounds):  # round by round in a rotating order, so load changes hit every shape alike
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            call(*key)
            times[key].append((time.perf_counter() - t0) * 1000)
    return CallCosts({key: min(values) for key, values in times.items()})


def describe(costs: CallCosts, step_width: int) -> str:
    """One row's call costs in words (for info / diagnostics): 'step 9.3 ms, verify[3] 1.12 steps, ...'."""
    step = costs.cost(1, step_width, step_width)
    if not step:
        return "not measured yet"
    widths = sorted(w for (j, w) in costs.ms if j == 1 and w != step_width)
    return f"step {step:.1f} ms" + "".join(f", verify[{w}] {costs.cost(1, w, step_width) / step:.2f} steps"
                                           for w in widths)


# ---------------------------------------------------------------------------------------------
# One request's k


@dataclass
class KChoice:
    """One request's k at every iteration (speculative.k: auto). ks: the k a verify call can carry (the
    runner has its width and the drafter can propose it), ascending, non-empty."""
    ks: tuple[int, ...]
    accept: list[float] = field(default_factory=list)  # (max k,) a_i: P(draft i accepted | 1..i-1 were), this stretch
    mean: list[float] = field(default_factory=list)    # (max k,) the same over the drafter's long run (SLOW)
    draft_ms: float = 0.0      # decayed ms of drafting per draft token
    k: int = -1                # the running k (0 = plain steps); -1: start at the largest
    since_probe: int = 0       # iterations at k = 0 since the last probe (or since k became 0)
    due: int = PROBE_GAP       # since_probe at which the next probe runs (gap(), set as k becomes 0 and per probe)
    idle: int = 0              # plain steps before the running probe
    failed: int = 0            # probes with a rejected draft since speculation ran or a probe's drafts were all accepted
    probe_ms: float = 0.0      # decayed ms of a probe's proposal, the drafter's catch-up included (0: none yet)
    probing: bool = False      # this iteration's k is a probe
    probed: bool = False       # a probe's outcome came in since the last choice (at k = 0 only that can restart)
    fresh: bool = False        # no choice made yet for this request (KChoice.after)
    hit: bool = False          # the last probe had a draft accepted
    probes: int = 0
    switches: int = 0          # changes of the running k
    verifies: int = 0          # verify outcomes observed
    streak: int = 0            # consecutive iterations speculating (not probes) up to this one
    doubt: int = 0             # verifies this stretch's estimate said stop, net of those it said go
    why: str = ""              # the last decision in words (speculation_off_reason)

    def __post_init__(self):
        if not self.ks:
            raise ValueError("KChoice needs at least one k")
        self.ks = tuple(sorted(self.ks))
        self.accept = self.accept or [PRIOR] * self.ks[-1]
        self.mean = self.mean or list(self.accept)
        self.k = self.ks[-1] if self.k < 0 else self.k

    @classmethod
    def after(cls, previous: KChoice | None, ks: Sequence[int]) -> KChoice:
        """A new request's choice, starting from where the previous request with the same drafter left its
        estimates: a new text's stretch is not known yet, so both estimates start at the drafter's long run,
        with the drafting and probe costs, the running k and the probes' cadence and back-off. One that was
        speculating goes on; one at plain decoding probes at once when its long run pays (a probe's outcome,
        not the long run alone, restarts it: heads that pay on one kind of prompt do not on the next) and
        otherwise probes on schedule. None: the first request (the prior, the largest k)."""
        if previous is None:
            return cls(tuple(ks))
        ks = tuple(sorted(ks))
        mean = (previous.mean + [PRIOR] * ks[-1])[:ks[-1]]
        k = previous.k if previous.k in (0, *ks) else ks[-1]
        return cls(ks, accept=list(mean), mean=mean, draft_ms=previous.draft_ms, k=k, verifies=previous.verifies,
                   since_probe=previous.since_probe, due=previous.due, failed=previous.failed,
                   probe_ms=previous.probe_ms, fresh=True)

    def expected_tokens(self, k: int, estimate: Sequence[float] | None = None) -> float:
        """Tokens one verify of k drafts emits: 1 + a_1 + a_1 a_2 + ... + a_1 .. a_k (a: accept, or estimate)."""
        total, reach = 1.0, 1.0
        for a in (self.accept if estimate is None else estimate)[:k]:
            reach *= a
            total += reach
        return total

    def rates(self, cap: int, costs: CallCosts, rows: int, step_width: int,
              estimate: Sequence[float] | None = None) -> dict[int, float]:
        """k -> expected tokens per ms for k = 0 and every k <= cap ({} when the step was never timed), from
        the stretch's acceptance (or estimate)."""
        step = costs.cost(rows, step_width, step_width)
        if not step:
            return {}
        out = {0: 1.0 / step}
        for k in self.ks:
            if k <= cap and (ms := costs.cost(rows, k + 1, step_width)):
                out[k] = self.expected_tokens(k, estimate) / (ms + k * self.draft_ms)
        return out

    def choose(self, cap: int, costs: CallCosts, rows: int, step_width: int) -> int:
        """This iteration's k (0 = a plain step) at most cap (the load policy's k), for rows decoding slots."""
        probed, self.probing, self.probed = self.probed, False, False
        if self.k == 0 and not probed and self.verifies:  # plain decoding: nothing new to weigh, a probe due?
            if self.fresh:  # a new request at plain decoding: probe at once when the drafter pays on the whole
                rates = self.rates(cap, costs, rows, step_width, self.mean)
                if len(rates) > 1 and max(rates.values()) > rates[0] * (1 + MARGIN):
                    self.since_probe = self.due
            self.fresh = False
            return self._plain(cap)
        self.fresh = False
        rates = self.rates(cap, costs, rows, step_width)
        if len(rates) < 2 or not self.verifies:  # nothing timed or seen yet (or no k under the cap): the largest
            return max((k for k in self.ks if k <= cap), default=0)
        best = max((k for k in rates if k), key=lambda k: (rates[k], -k))  # the best k > 0
        running = self.k if self.k in rates else max((k for k in rates if k <= self.k), default=0)
        losing = bool(running) and rates[running] < rates[0] * (1 + KEEP)  # this stretch says stop
        self.doubt = self.doubt + 1 if losing else max(self.doubt - 1, 0)  # net of the verifies that say go on
        if running == 0:  # only new evidence restarts speculation, not a cost that moved
            new = best if probed and self.hit and rates[best] > rates[0] * (1 + MARGIN) else 0
        elif losing and (self.doubt > DOUBT or (steady := self.rates(cap, costs, rows, step_width, self.mean)).get(
                running, 0) < steady[0] * (1 + KEEP)):
            new = 0  # the drafter's long run does not say it pays either, or this stretch has said stop too long
        else:  # another k costs nothing to switch to (only starting and stopping the drafter do)
            new = best
        if new != self.k:
            self.switches += 1
            self.why = self._words(rates, new)
            if new == 0:
                self.since_probe = 0
        self.k = new
        if new:
            self.failed = 0
            self.streak += 1
            return new
        self.due = self.gap(min(k for k in rates if k), costs, rows, step_width)
        return self._plain(cap)

    def _plain(self, cap: int) -> int:
        """At k = 0: a plain step, or a probe at the smallest k when one is due."""
        self.streak = 0
        self.since_probe += 1
        if self.since_probe < self.due or not (ks := [k for k in self.ks if k <= cap]):
            return 0
        self.idle, self.since_probe, self.probing = self.since_probe, 0, True  # does it match again?
        self.probes += 1
        return ks[0]

    def gap(self, k: int, costs: CallCosts, rows: int, step_width: int) -> int:
        """Iterations at k = 0 before the next probe at k: the first gap = the probe's extra cost over a step
        (its call, its proposal as measured: catch-up included) / PROBE_SHARE, at least PROBE_GAP, doubled per
        failed probe up to the budget gap = that extra cost / PROBE_BUDGET, at most PROBE_GAP_MAX (never under
        the first gap)."""
        step = costs.cost(rows, step_width, step_width)
        extra = (costs.cost(rows, k + 1, step_width) + (self.probe_ms or k * self.draft_ms) - step) / step
        first = max(PROBE_GAP, int(extra / PROBE_SHARE) + 1)
        budget = max(min(int(extra / PROBE_BUDGET) + 1, PROBE_GAP_MAX), first)
        return min(first << self.failed, budget)

    def observe(self, drafted: int, accepted: int, asked: int = 0) -> None:
        """A verify of `drafted` drafts (the proposal asked for `asked`, 0: as many) accepted the first
        `accepted`: positions 1..accepted were accepted, position accepted+1 was not, whether drafted and
        rejected or not drafted at all (a drafter that stops short, an n-gram match running out, emits no
        more at that position either); later positions were not tried. When a whole full window was
        accepted, the positions past it move toward the last one's estimate (half weight), so a k larger
        than the running one gets tried. Both estimates learn it: accept (WEIGHT: this stretch of text)
        and mean (SLOW: the drafter's long run), each the average of the drafter's first verifies until its
        weight takes over (the prior is replaced, not nudged). A probe's
        outcome lands on an estimate aged by the plain steps before it: accept relaxes toward mean by
        RELAX per plain step (what a bad stretch taught fades as the text moves on)."""
        self.verifies += 1
        self.probed = self.probing
        window = max(drafted, asked)
        if self.probing:  # back off after a probe with a rejected draft, start over after one accepted whole
            self.hit = accepted > 0  # only a probe that matched can restart speculation
            self.failed = 0 if accepted == window else min(self.failed + 1, 16)
            keep = (1 - RELAX) ** self.idle
            self.accept = [m + keep * (a - m) for a, m in zip(self.accept, self.mean)]
        first = 1 / self.verifies  # a drafter's first outcomes replace the prior
        for estimate, weight in ((self.accept, max(WEIGHT, first)), (self.mean, max(SLOW, first))):
            for i in range(min(accepted + 1, window, len(estimate))):
                estimate[i] += weight * ((1.0 if i < accepted else 0.0) - estimate[i])
            if 0 < accepted == window:  # a whole window accepted: the positions past it follow its last (half weight)
                last = estimate[min(window, len(estimate)) - 1]
                for i in range(window, len(estimate)):
                    estimate[i] += weight / 2 * (last - estimate[i])

    def silent(self) -> None:
        """The drafter proposed nothing this iteration: a probe that drafted nothing probes again next time."""
        if self.probing:
            self.since_probe, self.probes = self.due, self.probes - 1

    def drafted(self, k: int, ms: float) -> None:
        """A proposal of at most k drafts took ms. Drafting ms per token counts only while speculation runs
        on (a proposal after plain steps, a probe's or the first, also catches the drafter up on the tokens
        it has not seen); a probe's whole proposal is the probe's cost (gap). Until speculation has run on,
        ms / k stands in for the drafting cost (an upper bound: a drafter that never ran two iterations
        in a row, e.g. layer-skip, is not taken as free)."""
        if k <= 0:
            return
        if self.streak >= 2:
            self.draft_ms += WEIGHT * (ms / k - self.draft_ms)
            return
        if self.probing:
            self.probe_ms = self.probe_ms + WEIGHT * (ms - self.probe_ms) if self.probe_ms else ms
        if not self.draft_ms:
            self.draft_ms = ms / k

    def _words(self, rates: dict[int, float], new: int) -> str:
        acceptance = " ".join(f"{a:.2f}" for a in self.accept)
        expected = ", ".join(f"k={k} {rates[k] * 1000:.0f}" for k in sorted(rates))
        return (f"{'plain decoding' if not new else f'k={new}'} expected fastest (tok/s {expected}; acceptance per "
                f"position {acceptance}; drafting {self.draft_ms:.2f} ms per token)")

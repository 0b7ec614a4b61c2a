"""Suffix drafting (SuffixDecoding: Oliaro et al., arXiv 2411.04975): a model-free drafter over the current
request and the engine's own earlier answers.

Two parts, as the paper's two suffix trees (its section 4): the request's own (its prompt and output so far; one
SuffixStore per request) and the global store (the outputs of earlier and running requests: one SuffixStore per
engine, shared by the slots, holding at most speculative.suffix_max_requests answers, the oldest evicted first).
Both grow with every token the target chose (accepted drafts and its corrections), whenever the loop hands the
drafter the sequence (propose) and as the request leaves (finish), so a slot drafts from answers another slot
finished or is still writing. Only the speed depends on that: the target verifies every draft.

A proposal follows the paper's rules, as one chain (our verify graphs verify one):
  1. pattern match: the longest suffix of the sequence, MIN_MATCH to suffix_max_depth tokens long, that occurs in
     the part (the request's own earlier tokens; the store's answers but the request's own);
  2. the draft: of that match's occurrences the most frequent next token, then the most frequent one after it
     among the occurrences that continue so, and on (the paper's expansion by the estimated probability
     D(N) = prod C(child) / C(parent) along the path, C counting occurrences as its suffix tree does); it stops
     before the first token whose D falls under suffix_min_prob (Arctic Inference's min_token_prob), at
     suffix_spec_factor x the match length (the paper's MAX_SPEC = alpha p: a longer match earns a longer draft)
     or at k;
  3. scoring: of the two parts' drafts the one with the larger sum of D (the paper's expected accepted length);
     a tie goes to the request's own;
  4. the gate (ours, not the paper's: on a CPU a wasted verify costs more than the plain step it replaces):
     a part's draft is proposed only while its kind of match (part x match length, GATE_MATCH and longer
     alike) has earned break-even accepted tokens per proposal in this request (drafters/ngram.Gate, n-gram's
     rule), so a 2-token match found once in an unrelated answer (D = 1) drafts a few times, then stays silent.
A tree (the paper's full form) would verify the runner-up continuations in the same call; a chain drafts a
branching match only while its most frequent branch holds suffix_min_prob.

Memory: a store holds at most max_requests answers (each within graphs.max_context tokens): per token its id (4
bytes) and one index entry (8 bytes) plus the index's keys; memory() reports the tokens and that estimate.

Persistence (speculative.suffix_persist): the store is a file (JSON: FORMAT, the stamp of the tokenizer its ids
belong to, the answers oldest first) written atomically (graphs/folders.write_atomic) when a request leaves and
SAVE_EVERY_S has passed since the last write, and by save() at the engine's close; load() reads it at start. A file
that cannot be read, is not this FORMAT, belongs to another tokenizer or holds an id outside the vocabulary is
ignored with a warning naming it and why (an empty store then, overwritten at the next save).
"""
from __future__ import annotations

import json
import logging
import time
from array import array
from collections import Counter
from pathlib import Path

from spec_edge.graphs.folders import write_atomic

from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.ngram import Gate

MIN_MATCH = 2       # the shortest match that drafts: the index's key, the two tokens before a position
RECENT = 256        # a match is looked for among its key's most recent RECENT occurrences (bounds a proposal)
SHIFT = 24          # an index entry: answer id << SHIFT | position
GATE_MATCH = 4      # the gate tells matches apart by part and length up to this (a longer one counts as this)
KEY_BYTES = 150     # a distinct key in the index: its int, its dict slot and its array's header (estimate)
FORMAT = "spec_edge suffix store 1"
SAVE_EVERY_S = 60.0  # a persisted store is written when a request leaves at least this long after the last write


class SuffixStore:
    """Token lists (answers) and the index of each position by the MIN_MATCH tokens before it, bounded to the
    max_requests most recent lists. Not thread-safe: the loop's thread alone writes it (memory() reads counts)."""

    def __init__(self, max_requests: int, max_depth: int, path: Path | None = None, stamp: str = ""):
        self.max_requests, self.max_depth = max_requests, max_depth
        self.path, self.stamp = path, stamp  # persisted: its file, the stamp of the tokenizer its ids belong to
        self._saved = time.monotonic()      # the last write (or the load)
        self.lists: dict[int, array] = {}  # answer id -> its tokens ('i'), oldest first
        self.index: dict[int, array] = {}  # key (a << 20 | b) -> entries ('q'), oldest first
        self.tokens = 0                    # tokens held (every list)
        self._next = 0

    def open(self) -> int:
        """A new empty answer's id, evicting the oldest answer(s) beyond max_requests."""
        while len(self.lists) >= self.max_requests:
            self._evict(next(iter(self.lists)))
        self._next += 1
        self.lists[self._next] = array("i")
        return self._next

    def _evict(self, answer: int) -> None:
        tokens = self.lists.pop(answer)
        self.tokens -= len(tokens)
        for key in {tokens[e - 2] << 20 | tokens[e - 1] for e in range(MIN_MATCH, len(tokens))}:
            kept = array("q", (entry for entry in self.index[key] if entry >> SHIFT != answer))
            if kept:
                self.index[key] = kept
            else:
                del self.index[key]

    def extend(self, answer: int, tokens) -> None:
        """Append tokens to answer (gone when evicted: ignored); index every position with a token after it."""
        own = self.lists.get(answer)
        if own is None or not tokens:
            return
        start = max(len(own), MIN_MATCH)
        own.extend(tokens)
        self.tokens += len(tokens)
        for e in range(start, len(own)):
            self.index.setdefault(own[e - 2] << 20 | own[e - 1], array("q")).append(answer << SHIFT | e)

    def propose(self, seq: list[int], k: int, spec_factor: float, min_prob: float,
                skip: int = 0) -> tuple[list[int], float, int]:
        """(the draft for seq, its score = sum of D, the match length) from the longest match in answers other
        than skip; ([], 0, 0) when none."""
        if len(seq) < MIN_MATCH:
            return [], 0.0, 0
        entries = self.index.get(seq[-2] << 20 | seq[-1])
        if not entries:
            return [], 0.0, 0
        best, found = 0, []  # the longest match's length, its occurrences (tokens, position after it)
        depth = min(self.max_depth, len(seq))
        for entry in reversed(entries[-RECENT:]):
            answer, e = entry >> SHIFT, entry & ((1 << SHIFT) - 1)
            if answer == skip:
                continue
            tokens = self.lists[answer]
            n = MIN_MATCH
            while n < depth and n < e and tokens[e - n - 1] == seq[-n - 1]:
                n += 1
            if n > best:
                best, found = n, [(tokens, e)]
            elif n == best:
                found.append((tokens, e))
        draft, score, prob = [], 0.0, 1.0
        for i in range(min(k, int(spec_factor * best))):
            counts = Counter(tokens[e + i] for tokens, e in found if e + i < len(tokens))
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            prob *= count / len(found)
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            found = [(tokens, e) for tokens, e in found if e + i < len(tokens) and tokens[e + i] == token]
        return draft, score, best

    def load(self, vocab_size: int) -> None:
        """Take the answers of the store's file (none there: nothing); a file not to be trusted: a warning, nothing."""
        try:
            data = json.loads(self.path.read_text())
            why = ("not a suffix store of this format" if not isinstance(data, dict) or data.get("format") != FORMAT
                   else "made for another tokenizer" if data.get("stamp") != self.stamp
                   else "" if all(isinstance(t, int) and 0 <= t < vocab_size for a in data["answers"] for t in a)
                   else "a token id outside the vocabulary")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable, truncated, not JSON, other shapes
            why = f"unreadable ({type(err).__name__}: {err})"
        if why:
            logging.getLogger("spec_edge").warning(f"suffix store {self.path} ignored: {why}; starting empty")
            return
        for answer in data["answers"][-self.max_requests:]:
            self.extend(self.open(), answer)

    def save(self) -> None:
        """Write the store's file (persisted stores; any other: nothing)."""
        if self.path is not None:
            write_atomic(self.path, json.dumps({"format": FORMAT, "stamp": self.stamp,
                                                "answers": [a.tolist() for a in self.lists.values()]}))
            self._saved = time.monotonic()

    def memory(self) -> dict[str, int]:
        """What the store holds: answers, tokens, index keys and the bytes they take (estimate)."""
        return {"answers": len(self.lists), "max_answers": self.max_requests, "tokens": self.tokens,
                "bytes": 12 * self.tokens + KEY_BYTES * len(self.index)}


class SuffixDrafter:
    """One request's suffix drafter: its own part over its prompt and output, the engine's store beside it."""
    name = "suffix"

    def __init__(self, store: SuffixStore, max_depth: int, spec_factor: float, min_prob: float):
        self.store, self.max_depth = store, max_depth
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.own = SuffixStore(1, max_depth)
        self._own_id = self._answer = self._fed = 0
        self._gate, self._key = Gate(), ("own", MIN_MATCH)  # the last draft's kind of match
        self._seq: list[int] | None = None  # the loop's sequence of the request (extended in place until it leaves)

    def start(self, prompt_ids: list[int]) -> None:
        self.own = SuffixStore(1, self.max_depth)
        self._own_id = self.own.open()
        self.own.extend(self._own_id, prompt_ids)
        self._answer, self._fed, self._seq = self.store.open(), len(prompt_ids), None
        self._gate = Gate()

    def _catch_up(self, seq: list[int]) -> None:
        """Both parts take the tokens chosen since the last call (the output: the store holds no prompt)."""
        self._seq, new = seq, seq[self._fed:]
        self.own.extend(self._own_id, new)
        self.store.extend(self._answer, new)
        self._fed = len(seq)

    def propose(self, seq: list[int], k: int, sampler=None) -> Draft | None:
        self._catch_up(seq)
        drafts = []  # (score, gate key, tokens) of each part whose kind of match has been paying
        for part, store, skip in (("own", self.own, 0), ("past", self.store, self._answer)):
            tokens, score, n = store.propose(seq, k, self.spec_factor, self.min_prob, skip=skip)
            key = (part, min(n, GATE_MATCH))
            if tokens and self._gate.open(key):
                drafts.append((score, key, tokens))
        if not drafts:
            return None
        _, self._key, tokens = max(drafts, key=lambda draft: draft[0])  # a tie: the first, the request's own
        return Draft(tokens=tokens, q_draft=None)  # deterministic: one-hot q when sampling

    def finish(self) -> None:  # the request left: the store takes its last tokens (the loop's final sequence)
        if self._seq is not None:
            self._catch_up(self._seq)
        if time.monotonic() - self.store._saved >= SAVE_EVERY_S:
            self.store.save()

    def check_k(self, k: int) -> None:  # any k: the draft is as long as the match earns, at most k
        pass

    def forget(self) -> None:  # no cache: its parts are token lists
        pass

    def observe(self, n_proposed: int, n_accepted: int) -> None:
        self._gate.record(self._key, n_accepted)

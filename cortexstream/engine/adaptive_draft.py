"""How many tokens one sequence drafts next: k chosen from its acceptance rates, down to 0 when drafting does not pay.

Cost model. Verifying k drafted tokens in one forward costs about `1 + c*k` plain decode steps of the sequence
(`c` = `cost_per_draft`): small when the step is bound by reading the weights (the extra tokens add compute and KV
reads, not weight reads), near 1 when a batch is compute-bound and every row costs what a decode row does. The
engine measures it (engine/verify_cost.py) and sets it with `set_cost_per_draft` as the batch changes. A verify
step emits the accepted prefix of the draft plus one token of the target's own.

Two rates, not one, per context. Drafted tokens are not accepted independently: the first token of a draft is the
weak one (the proposal may not fit at all), and once it is accepted the rest usually follows (the output is copying
a stretch of its input). How likely the first token is depends on the draft's context, and a sequence keeps a
first-token rate and a continuation rate per context, so a verify step with k drafts emits on average
`E(k) = 1 + a1 * (1 + a + ... + a^(k-1))` tokens, `a1` the first-token rate of its context and `a` the continuation
rate; with both equal it is the independent model's `(1 - a^(k+1)) / (1 - a)`. The contexts (docs/speculative.md
gives the measured rates):
- Prompt lookup: the class of the match's extent, how far back the copy goes (engine/match_extent.py), each with
  its measured rates as a prior. It is known only once the sequence's last token is read, so k is chosen after the
  read (`draft_length`), and whether to read at all is decided before it (below).
- A draft model: whether the previous verify accepted its whole draft (a draft after a full acceptance hits far
  more often than one after a rejection), known before the step; the continuation rate is shared by both states.

Plain decoding emits 1 token per unit of cost, so k is the one in 1..k_max that maximises `E(k) / (1 + f + c*k)`,
or 0 (plain decoding) when none exceeds 1; with k=1 that needs `a1 > f + c`. `f` (`fixed_cost`, also measured) is
what a drafting step costs whatever k: the pipelined decode it gives up. Once the last token was read (prompt
lookup), `f` is paid anyway, and drafting is weighed against a plain token at `1 / (1 + f)`.

The rates are estimated per drafted token as trials: a step that proposed p tokens and had j accepted made one
first-token trial (a success when j >= 1) and `min(j, p - 1)` continuation trials with `max(0, j - 1)` successes
(the tokens after the first rejection were never tested). Each rate is an exponential moving average: its
successes and trials decay by `decay` per step that tested it, and the rate is their ratio, starting from the
context's prior (`initial_rate` for both states without contexts) worth `prior_trials` trials. A proposal that
came back empty (the proposer had nothing) cost nothing and tested nothing, so it leaves the estimates alone.

Reading costs. A drafting sequence needs its last token read, so the step gives up the pipelined decode for the whole
batch. With prompt lookup a sequence reads after a fully accepted draft (the copy is expected to go on, in a class
as long or longer) and otherwise only while the classes its reads found (decayed frequencies, no match included)
save more than `f` (plus `MIN_READ_SAVING`): the mean over them of the tokens a draft there gains net of its rows.

At k = 0 a sequence would never learn that drafting started to pay (a prompt-lookup proposer starts hitting when
the output begins quoting the prompt), so every so often it drafts one token again: a probe. Probes cost more than
their row: a drafting sequence needs its last token read, so the step that probes gives up the pipelined decode for
the whole batch. Hence:
- Aligned probes. Given the engine's step clock, a sequence probes on steps that are multiples of its probe interval
  (after at least half an interval at k = 0), so the idle sequences of a batch probe in the same step instead of
  each in its own. Without a clock (a sequence alone) it probes every interval steps of its own.
- Back-off. The interval starts at `probe_every` and doubles after each probe that leaves k at 0, up to
  `probe_every * max_backoff`; a probe that brings k back above 0 resets it.
- An empty probe (the proposer had nothing) counts as made: it tested nothing and changes no estimate, and the next
  probe waits for the next interval, instead of giving up the pipelined decode on every step until the proposer
  finds something (SmolLM2, open-ended chat, 8 concurrent: 40-60 of 130 steps were unaligned probes, drained).
Deterministic: no randomness.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Mapping

from cortexstream.errors import InvalidArgumentError


def expected_tokens(rate: float, k: int, first: float | None = None) -> float:
    """Tokens one verify step with k drafts emits on average: the first draft accepted with probability `first`
    (None: `rate`), each later one with probability `rate` given the ones before it were."""
    first = rate if first is None else first
    run = float(k) if rate >= 1.0 else (1.0 - rate ** k) / (1.0 - rate)  # 1 + rate + ... + rate^(k-1)
    return 1.0 + first * run


# Plain steps a read must be expected to save beyond the pipelined decode it gives up. Where that is measured as 0
# (this CPU, one sequence) it keeps a lingering estimate, a context seen once long ago, from reading for nothing.
MIN_READ_SAVING = 0.01


class _Rate:
    """A decayed rate of successes over trials, starting from a prior."""

    def __init__(self, rate: float, trials: float) -> None:
        self.successes, self.trials = rate * trials, trials

    @property
    def value(self) -> float:
        return self.successes / self.trials

    def add(self, decay: float, successes: int, trials: int) -> None:
        self.successes = decay * self.successes + successes
        self.trials = decay * self.trials + trials


def _check(name: str, value: Any, ok: bool, rule: str) -> None:
    if isinstance(value, bool) or not ok:
        raise InvalidArgumentError(f"{name}: {value!r} is invalid, {rule}")


def _check_cost(value: Any) -> None:
    _check("cost_per_draft", value, isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
           "must be a finite number >= 0")


class AdaptiveDraftLength:
    """The draft length of one sequence: `next_k()` before a step, `record(proposed, accepted)` after it.

    Without `contexts` the draft's context is the state above (the previous verify accepted everything, or not),
    known before the step. With `contexts` (prompt lookup: the class of the proposer's match, see
    engine/match_extent.py) it is known only once the last token is read: `next_k` then says whether to read and
    propose (the k of the expected context, or a probe), and `draft_length(context)` says how many tokens to draft
    in the context found. `contexts` maps each context to the prior (first-token rate, continuation rate)."""

    def __init__(self, k_max: int, adaptive: bool = True, *, cost_per_draft: float = 0.1, decay: float = 0.9,
                 initial_rate: float = 0.8, prior_trials: float = 4.0, probe_every: int = 16,
                 max_backoff: int = 8, contexts: Mapping[Hashable, tuple[float, float]] | None = None) -> None:
        _check("k_max", k_max, isinstance(k_max, int) and k_max >= 1, "must be an integer >= 1")
        if not isinstance(adaptive, bool):
            raise InvalidArgumentError(f"adaptive: {adaptive!r} must be a bool")
        _check_cost(cost_per_draft)
        _check("decay", decay, isinstance(decay, (int, float)) and 0 < decay < 1, "must be in (0, 1)")
        _check("initial_rate", initial_rate, isinstance(initial_rate, (int, float)) and 0 <= initial_rate <= 1,
               "must be in [0, 1]")
        _check("prior_trials", prior_trials, isinstance(prior_trials, (int, float)) and math.isfinite(prior_trials)
               and prior_trials > 0, "must be a finite number > 0")
        _check("probe_every", probe_every, isinstance(probe_every, int) and probe_every >= 1,
               "must be an integer >= 1")
        _check("max_backoff", max_backoff, isinstance(max_backoff, int) and max_backoff >= 1,
               "must be an integer >= 1")
        for key, rates in (contexts or {}).items():
            _check("contexts", contexts, key is not None and isinstance(rates, tuple) and len(rates) == 2 and all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates),
                "must map contexts (not None) to (first-token rate, continuation rate) pairs in [0, 1]")
        self.k_max = k_max
        self.adaptive = adaptive
        self.cost_per_draft = float(cost_per_draft)
        self.fixed_cost = 0.0
        self.decay = float(decay)
        self.probe_every = probe_every
        self.max_backoff = max_backoff
        self.probe_interval = probe_every  # steps between probes now (backs off while probes fail)
        self.by_context = contexts is not None
        priors = dict(contexts) if contexts is not None else {
            hit: (initial_rate, initial_rate) for hit in (True, False)}
        # per context: the first draft token's rate and the rate of every later token given the ones before it
        # were accepted (without contexts the continuation rate is one, shared by both states)
        self._first = {key: _Rate(float(first), float(prior_trials)) for key, (first, _) in priors.items()}
        shared = _Rate(float(initial_rate), float(prior_trials))
        self._continuation = {key: shared if contexts is None else _Rate(float(rest), float(prior_trials))
                              for key, (_, rest) in priors.items()}
        self._hit = False  # the previous verify accepted its whole draft
        self._context: Hashable | None = None if self.by_context else False  # the next draft's context, if known
        self._seen: dict[Hashable | None, float] = {}  # decayed counts of the contexts reads found (by_context)
        self._probing = False  # next_k() returned a probe
        self._k = self._reading_k()
        self._idle_steps = 0  # steps at k = 0 since the last probe was recorded

    @property
    def acceptance_rate(self) -> float:
        """The current estimate of the probability that the next draft's first token is accepted, in its expected
        context (without contexts: after a fully accepted draft or after a rejection; with contexts and none
        expected: the mean over the contexts' priors and estimates)."""
        if self._context is None:
            return sum(r.value for r in self._first.values()) / len(self._first)
        return self._first[self._context].value

    @property
    def continuation_rate(self) -> float:
        """The current estimate of the probability that a drafted token after the first is accepted, given the ones
        before it were (in the expected context, as `acceptance_rate`)."""
        if self._context is None:
            return sum(r.value for r in self._continuation.values()) / len(self._continuation)
        return self._continuation[self._context].value

    @property
    def k(self) -> int:
        """The draft length the estimate chooses now (0: plain decoding), without the probe; with contexts, above 0
        when reading the last token to find the context pays."""
        return self._k

    def _best_k(self, context: Hashable, sunk: bool = False) -> int:
        """The k that emits most tokens per unit of cost in `context`, 0 when none beats plain decoding. `sunk`: the
        step already gave up its pipelined decode (the context was read), so a plain token costs 1 + f too."""
        if not self.adaptive:
            return self.k_max
        first, rate = self._first[context].value, self._continuation[context].value
        best_k, best_gain = 0, 1.0 / (1.0 + self.fixed_cost) if sunk else 1.0
        for k in range(1, self.k_max + 1):
            gain = expected_tokens(rate, k, first) / (1.0 + self.fixed_cost + self.cost_per_draft * k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k

    def _saved(self, context: Hashable | None) -> float:
        """Plain steps one read in `context` saves by drafting there (None: no match, nothing)."""
        if context is None:
            return 0.0
        k = self._best_k(context, sunk=True)
        if k == 0:
            return 0.0
        first, rate = self._first[context].value, self._continuation[context].value
        return max(0.0, expected_tokens(rate, k, first) - 1.0 - self.cost_per_draft * k)

    def _reading_k(self) -> int:
        if self._context is not None:
            return self._best_k(self._context)
        if not self.adaptive:
            return self.k_max
        # no context expected (prompt lookup after a rejection): read when the contexts reads found save more than
        # the pipelined decode the read gives up; before any read was seen, read to find out
        total = sum(self._seen.values())
        if total == 0:
            return self.k_max
        saved = sum(n * self._saved(context) for context, n in self._seen.items()) / total
        return self.k_max if saved > self.fixed_cost + MIN_READ_SAVING else 0

    def set_cost_per_draft(self, cost_per_draft: float, fixed_cost: float = 0.0) -> None:
        """A new cost of one drafted token and of drafting at all (both in plain decode steps of this sequence); k is
        chosen again for them."""
        _check_cost(cost_per_draft)
        _check("fixed_cost", fixed_cost, isinstance(fixed_cost, (int, float)) and math.isfinite(fixed_cost)
               and fixed_cost >= 0, "must be a finite number >= 0")
        if (float(cost_per_draft), float(fixed_cost)) != (self.cost_per_draft, self.fixed_cost):
            self.cost_per_draft, self.fixed_cost = float(cost_per_draft), float(fixed_cost)
            self._k = self._reading_k()

    def _probe_due(self, idle_steps: int, clock: int | None) -> bool:
        if clock is None:
            return idle_steps >= self.probe_interval
        return idle_steps >= max(1, self.probe_interval // 2) and clock % self.probe_interval == 0

    def will_draft(self, clock: int | None = None) -> bool:
        """Whether `next_k(clock)` will be above 0 (a chosen k, or a probe due), without counting a step. `clock`:
        the engine's step number (aligns the probes of a batch), None for a sequence counting its own steps."""
        return self._k > 0 or self._probe_due(self._idle_steps + 1, clock)

    def next_k(self, clock: int | None = None) -> int:
        """How many tokens to draft this step (call once per step): the chosen k, or 1 when probing from 0. With
        contexts, above 0 means: read the last token and call `draft_length` with the context found."""
        self._probing = False
        if self._k > 0:
            return self._k
        self._idle_steps += 1
        self._probing = self._probe_due(self._idle_steps, clock)
        return 1 if self._probing else 0

    def draft_length(self, context: Hashable | None) -> int:
        """(With contexts, after `next_k` > 0.) The tokens to draft in `context`, the class of the match found (None:
        no match; then 0). A probe drafts at least one token, so every context's rates keep being tested; a read
        that drafts nothing counts as an empty proposal (see `record`)."""
        if not self.by_context:
            raise InvalidArgumentError("draft_length: this draft length has no contexts (its state is known)")
        if context is not None and context not in self._first:
            raise InvalidArgumentError(f"context: {context!r} is not one of {sorted(map(str, self._first))}")
        if self._context is None:  # what reads without an expectation find decides whether such reads pay
            for key in self._seen:
                self._seen[key] *= self.decay
            self._seen[context] = self._seen.get(context, 0.0) + 1.0
        self._context = context
        if context is None:
            return 0
        k = self._best_k(context, sunk=True)
        return max(1, k) if self._probing else k

    def record(self, proposed: int, accepted: int) -> None:
        """The outcome of a step: `proposed` tokens drafted (0: the proposer had nothing, or its context did not pay,
        which changes no estimate; at k = 0 it was a probe, made), `accepted` of them accepted by the target."""
        _check("proposed", proposed, isinstance(proposed, int) and proposed >= 0, "must be an integer >= 0")
        _check("accepted", accepted, isinstance(accepted, int) and 0 <= accepted <= proposed,
               f"must be an integer in 0..proposed ({proposed})")
        probing = self._k == 0
        self._idle_steps = 0
        if proposed == 0:
            if self.by_context:  # nothing drafted where it was read: no expectation for the next step
                self._context = None
                self._k = self._reading_k()
            return
        context = self._context if self.by_context else self._hit
        self._first[context].add(self.decay, 1 if accepted else 0, 1)
        continued = min(accepted, proposed - 1)  # later tokens tested: those after an accepted one
        if continued:
            self._continuation[context].add(self.decay, max(0, accepted - 1), continued)
        self._hit = accepted == proposed
        if self.by_context:  # a copy that went on is expected to go on (in a context as long or longer)
            self._context = context if self._hit else None
        else:
            self._context = self._hit
        self._k = self._reading_k()
        if self._k > 0:
            self.probe_interval = self.probe_every
        elif probing:  # a probe that did not pay: wait twice as long for the next
            self.probe_interval = min(2 * self.probe_interval, self.probe_every * self.max_backoff)

"""What a drafted row costs, measured online: a step's time fitted as `a + b * rows`, turned into the cost per draft
the adaptive draft length weighs (engine/adaptive_draft.py). Pure Python.

Why measured. Whether verifying k drafted tokens pays depends on what a row of a forward pass costs next to the pass
itself. A pass bound by reading the weights (a Mac, a small batch) computes extra rows almost for free; a batch on
a CPU that is already compute-bound pays for every row about what a decode row costs, and drafting loses there.

The model. A forward pass over `rows` query rows (decode rows and drafted rows) takes `a + b * rows` seconds. A
plain step of B sequences costs `a + b*B` for B tokens, so one token's share is `(a + b*B) / B`; k drafted tokens
of one sequence add `b*k`, which in units of that share is `c*k` with
`c = b*B / (a + b*B)`: near 0 when the fixed cost dominates (weight-bound), near 1 when rows dominate.

The fit. A running least-squares fit with exponential forgetting (every sum decays by `decay` per sample) over
observed (rows, seconds) pairs. The slope is only as good as the spread of the rows it was fitted over, so the cost
given out is the measured one blended with `prior` by that spread: `w*c + (1 - w)*prior`, with `w = I / (I +
prior_strength)` and `I` the remembered samples' weighted sum of squared row deviations. Until two row counts were
seen it is the prior; a few samples move it part of the way; many spread samples (drafts of varied length, a batch)
make it the measured cost. While the remembered samples hardly vary in rows (weighted variance under `min_spread`:
only probes of one draft token, the same batch) the slope is kept and only the level `a` follows the data, and as
the spread is forgotten the cost drifts back to the prior, so drafting is tried again and measured afresh instead of
staying off on an old estimate. The first pass of each row count is not a sample: a new shape's first pass
allocates and builds what later passes reuse (SmolLM2 on this CPU: 140-160 ms for a 5-row verify whose later
passes take 50-77 ms; that one sample set the cost per draft to 0.6 at a batch of 1, which turned drafting off for
good). A sample longer than `outlier` times the current prediction (a pause of the caller between steps, another
process) is clipped to it, so one stall moves the fit a bounded amount while a lasting change
still moves it.

What is timed (`timed_pass`). The engine times a step from launching its passes to applying its tokens. A plain
decode pass is pipelined: launched asynchronously and read during the next step, whose timer also covers building
that step's graph and which, when the caller is slower than the pass, waits for nothing. Such a step does not time
its pass honestly, so it is not a sample. A verify pass (drafted rows) is evaluated within its own step, and such a
step starts with nothing in flight (the scheduler drains every token first, since a drafting sequence drafts from
its last token): those are the samples. A pass with prompt chunks riding in it is not: a chunk's token attends to
its whole prefix and costs what a prompt token costs, not a decode row, and chunks of hundreds of tokens would set
the slope alone (Qwen2.5-Coder-1.5B drafted by the 0.5B, 8 prompts prefilling in turn: `a` = 16 s and `b` = 0, so a
drafted row looked free). The samples' time includes the step's Python (graph building, applying the tokens),
which is what a verify step costs; the plain pipelined step's cost `a + b*B` is extrapolated from them. A
pipelined step hides part of that Python behind the pass, so it costs less than `a + b*B`, and `c` understates what
drafting costs by the overlap it gives up: most where the step's Python is large next to its pass (a small model, a
small batch); the pipelining term below counts that overlap.

The pipelined decode a drafting step gives up is a term of its own too. A plain step that read the previous step's
tokens while its own pass was launched (`pipelined_pass`) is timed as the period of pipelined decoding, `T(B)`, a
decayed mean per batch size (first of each size skipped). When measured it is the unit instead of `a + b*B`, and a
step that drafts pays `f = (a + b*B) / T(B) - 1` on top of its rows, once, whatever k (`fixed_cost`; taken as if
the whole batch drafted, so shared by all). Where the step's Python is as long as its pass (a 135M model on a CPU)
that is a large share; where the pass dominates it is near 0. A batch whose sequences draft from their first step
would never run a plain step to time, so a batch size with no `T(B)` measured near it pauses drafting for a few
decode-only steps (`wants_plain_steps`; the scheduler asks it).

A draft model's passes are a term of their own: they grow with k, not with the verify rows. The runner times them
(`StepResult.draft_seconds`, out of the verify sample's seconds) and the estimate keeps their mean seconds per pass
by the number of sequences drafting in it (`observe_draft`, first pass of each count skipped as above). Drafting k
tokens takes k such passes for the whole batch, so one drafted token costs one sequence `t_d(B) / B` seconds, in
units of its share of a plain step: `r = t_d(B) / T(B)` (or over `a + b*B` before `T(B)` is measured), added to
`c`. A 0.5B model drafting for a 1.5B one costs about a third of a step per drafted token, which a weight-bound
single stream recovers and a compute-bound batch on a CPU does not.
"""

from __future__ import annotations

import math

from cortexstream.engine.step_plan import StepPlan, StepResult
from cortexstream.errors import InvalidArgumentError

# Samples of a batch size's pipelined period before drafting trusts it: the first ones after a prefill run slow
# (SmolLM2, 8 edits: 0.19 s against 0.15 s later), and a single one set the period for the rest of the run.
PIPELINED_SAMPLES = 3
# Plain steps a batch size may spend with drafting paused to measure its pipelined period (five do it: one launches
# from idle, the next is a shape's first sample, skipped, then PIPELINED_SAMPLES; the margin covers a step that could
# not pipeline).
PLAIN_STEPS_TO_MEASURE = 8

# What one drafted token costs, in decode steps, until measured. Above what a weight-bound pass's extra row costs:
# a drafting sequence also loses the pipelined decode (its next draft needs the token just sampled), and with
# half this a compute-bound batch of 8 on a CPU kept drafting at low acceptance (bench/results/speculative.md).
PRIOR_COST_PER_DRAFT = 0.2


def timed_pass(plan: StepPlan, result: StepResult, decode_seconds: float | None) -> tuple[int, float] | None:
    """(rows, seconds) of the step's decode pass when the engine's timer covered that pass whole and it held only
    decode and drafted rows (a verify pass without prompt chunks), else None. See the module docstring."""
    if not plan.decode or decode_seconds is None or not decode_seconds > 0 or result.mixed_tokens:
        return None
    decoding = {item.request_id for item in plan.decode}
    read_now = bool(result.accepted) and all(s.ready for s in result.sampled if s.request_id in decoding)
    if not read_now:
        return None  # launched asynchronously: its compute falls in the next step's timer
    seconds = decode_seconds - result.draft_seconds  # the draft model's passes are their own term
    if not seconds > 0:
        return None
    return sum(item.num_tokens for item in plan.decode), seconds


def pipelined_pass(plan: StepPlan, result: StepResult, decode_seconds: float | None,
                   had_in_flight: bool) -> tuple[int, float] | None:
    """(batch, seconds) of a plain pipelined decode step: it started with a pass in flight (its timer covers
    waiting for that pass and launching its own), decoded without drafts or prompt chunks, and left its tokens in
    flight; else None."""
    if not had_in_flight or not plan.decode or decode_seconds is None or not decode_seconds > 0:
        return None
    if result.accepted or result.mixed_tokens or plan.prefill or any(item.draft or item.model_draft
                                                                    for item in plan.decode):
        return None
    if any(s.ready for s in result.sampled):
        return None  # read within the step: not pipelined
    return len(plan.decode), decode_seconds


def drafted_passes(result: StepResult) -> tuple[int, int, float] | None:
    """(sequences, passes, seconds) of the step's draft-model passes, or None when it ran none."""
    if result.draft_passes < 1 or result.draft_sequences < 1 or not result.draft_seconds > 0:
        return None
    return result.draft_sequences, result.draft_passes, result.draft_seconds


def _check_seconds(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise InvalidArgumentError(f"seconds: {seconds!r} must be a finite number > 0")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name}: {value!r} must be an integer >= 1")


class _MeanByCount:
    """A decayed mean of seconds per count of sequences, read at the nearest measured count: each sample's weight
    decays by `decay` per newer one, and the mean is the weighted sum over the weights (so the first samples do not
    outweigh the later ones). The first sample of each count is skipped, as `VerifyCostModel.observe` skips a new
    shape's first pass."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._sums: dict[int, tuple[float, float, int]] = {}  # count -> (weighted seconds, weight, samples)
        self._seen: set[int] = set()

    def add(self, count: int, seconds: float) -> None:
        if count not in self._seen:
            self._seen.add(count)
            return
        total, weight, samples = self._sums.get(count, (0.0, 0.0, 0))
        self._sums[count] = (self.decay * total + seconds, self.decay * weight + 1.0, samples + 1)

    def has_near(self, count: int, samples: int = 1) -> bool:
        """Whether a count within a quarter of `count` (at least the count itself) has `samples` samples or more."""
        return any(abs(n - count) <= count // 4 and s[2] >= samples for n, s in self._sums.items())

    def nearest(self, count: int) -> float | None:
        if not self._sums:
            return None
        total, weight, _ = self._sums[min(self._sums, key=lambda n: (abs(n - count), n))]
        return total / weight


def _number(name: str, value: float, low: float, high: float, closed: bool = False) -> float:
    inside = isinstance(value, (int, float)) and (low <= value <= high if closed else low < value < high)
    if isinstance(value, bool) or not inside:
        interval = f"[{low}, {high}]" if closed else f"({low}, {high})"
        raise InvalidArgumentError(f"VerifyCostModel {name}: {value!r} must be a number in {interval}")
    return float(value)


class VerifyCostModel:
    """The per-engine estimate of a pass's time, `a + b * rows`: `observe(rows, seconds)` samples it,
    `cost_per_draft(B)` reads it. `prior`: the cost per draft before any measurement, blended with it later;
    `decay`: the weight a sample keeps per newer one (0.95: about the last 20 count); `min_spread`: the weighted
    variance of the remembered rows below which the slope is kept, not refitted; `outlier`: a sample is clipped to
    this many times the prediction; `prior_strength`: the spread of rows (squared deviations, summed over samples)
    that weighs as much as the prior."""

    def __init__(self, prior: float = PRIOR_COST_PER_DRAFT, *, decay: float = 0.95, min_spread: float = 0.05,
                 outlier: float = 4.0, prior_strength: float = 4.0) -> None:
        self.prior = _number("prior", prior, 0.0, 1.0, closed=True)
        self.decay = _number("decay", decay, 0.0, 1.0)
        self.min_spread = _number("min_spread", min_spread, 0.0, math.inf)
        self.outlier = _number("outlier", outlier, 1.0, math.inf)
        self.prior_strength = _number("prior_strength", prior_strength, 0.0, math.inf)
        self.samples = 0
        self.fixed_seconds: float | None = None  # a
        self.seconds_per_row: float | None = None  # b
        self._sums = [0.0] * 5  # decayed weight, x, x^2, y, x*y
        self._first_rows: int | None = None
        self._distinct = False  # two row counts seen
        self._shapes: set[int] = set()  # row counts whose first pass was seen (and not taken as a sample)
        self._last_seconds: float | None = None  # the latest verify sample's seconds (a plain step's upper bound)
        self._last_rows = 0  # and its rows
        self._draft_pass = _MeanByCount(self.decay)  # sequences drafting -> seconds of one draft pass
        self._pipelined = _MeanByCount(self.decay)  # batch -> seconds of a pipelined plain step
        self._plain_tries: dict[int, int] = {}  # batch -> steps spent with drafting paused to measure its period

    @property
    def fitted(self) -> bool:
        """Whether the slope has been measured (samples spread over at least two row counts)."""
        return self.seconds_per_row is not None

    @property
    def confidence(self) -> float:
        """The weight of the measured cost against the prior, in [0, 1): the remembered spread of rows over itself
        plus `prior_strength`."""
        if not self.fitted:
            return 0.0
        weight, sx, sxx = self._sums[:3]
        spread = max(0.0, sxx - sx * sx / weight)
        return spread / (spread + self.prior_strength)

    def predict(self, rows: int) -> float | None:
        """The fitted seconds of a pass of `rows` rows (None before the fit)."""
        if not self.fitted:
            return None
        return self.fixed_seconds + self.seconds_per_row * rows

    def observe(self, rows: int, seconds: float) -> None:
        """One timed pass: `rows` query rows computed in `seconds`."""
        _check_count("rows", rows)
        _check_seconds(seconds)
        if rows not in self._shapes:  # a shape's first pass allocates and builds what later ones reuse
            self._shapes.add(rows)
            return
        predicted = self.predict(rows)
        if predicted is not None and predicted > 0:
            seconds = min(seconds, self.outlier * predicted)
        if self._first_rows is None:
            self._first_rows = rows
        self._distinct = self._distinct or rows != self._first_rows
        self._last_seconds, self._last_rows = float(seconds), rows
        x, y = float(rows), float(seconds)
        self._sums = [self.decay * s + v for s, v in zip(self._sums, (1.0, x, x * x, y, x * y))]
        self.samples += 1
        self._refit()

    def _refit(self) -> None:
        weight, sx, sxx, sy, sxy = self._sums
        mean_x, mean_y = sx / weight, sy / weight
        spread = sxx / weight - mean_x * mean_x
        if self._distinct and spread >= self.min_spread:
            self.seconds_per_row = max(0.0, (sxy / weight - mean_x * mean_y) / spread)
        if self.seconds_per_row is not None:  # the level follows the data; a slope kept while rows hardly vary
            self.fixed_seconds = max(0.0, mean_y - self.seconds_per_row * mean_x)

    def observe_draft(self, sequences: int, passes: int, seconds: float) -> None:
        """A step's draft-model passes: `passes` passes with `sequences` sequences drafting took `seconds`."""
        _check_count("sequences", sequences)
        _check_count("passes", passes)
        _check_seconds(seconds)
        self._draft_pass.add(sequences, seconds / passes)

    def observe_pipelined(self, batch: int, seconds: float) -> None:
        """A plain pipelined decode step of `batch` sequences took `seconds` (`pipelined_pass`)."""
        _check_count("batch", batch)
        _check_seconds(seconds)
        self._pipelined.add(batch, seconds)

    def wants_plain_steps(self, batch: int) -> bool:
        """Whether decoding `batch` sequences should pause drafting to measure the pipelined period `T(B)`: fewer
        than `PIPELINED_SAMPLES` samples within a quarter of `batch`, and fewer than `PLAIN_STEPS_TO_MEASURE` steps
        spent trying. Without it a batch that drafts from its first step never sees a plain step, and the
        pipelining it gives up is never counted."""
        _check_count("batch", batch)
        return not self._pipelined.has_near(batch, PIPELINED_SAMPLES) and \
            self._plain_tries.get(batch, 0) < PLAIN_STEPS_TO_MEASURE

    def plain_step_paused(self, batch: int) -> None:
        """A step of `batch` sequences decoded with drafting paused (`wants_plain_steps`)."""
        _check_count("batch", batch)
        self._plain_tries[batch] = self._plain_tries.get(batch, 0) + 1

    def pipelined_step(self, batch: int) -> float | None:
        """The measured period of a pipelined plain step at the nearest measured batch size (None: not measured)."""
        return self._pipelined.nearest(batch)

    def _unit(self, batch: int) -> float | None:
        """A plain step's seconds: the pipelined period when measured, else the fit's `a + b*B` (None: neither)."""
        pipelined = self.pipelined_step(batch)
        if pipelined is not None:
            return pipelined
        return self.predict(max(1, batch)) if self.fitted else None

    def fixed_cost(self, batch: int) -> float:
        """What a drafting step costs once, whatever k, in units of a sequence's share of a plain step: the
        pipelining it gives up, `(a + b*B) / T(B) - 1`, weighed by `confidence` (0 until both are measured)."""
        pipelined = self.pipelined_step(batch)
        if pipelined is None or not self.fitted:
            return 0.0
        return self.confidence * max(0.0, self.predict(max(1, batch)) / pipelined - 1.0)

    def draft_cost(self, batch: int) -> float:
        """The draft model's share of one drafted token, `t_d(B) / T(B)` (see the module docstring): 0 before
        any draft pass was measured; the nearest measured count of drafting sequences stands in for `batch`; before
        the fit, the latest verify sample's seconds stand in for a plain step (an upper bound: drafting is not
        turned off on a guess)."""
        per_pass = self._draft_pass.nearest(batch)
        step = self._unit(batch) or self._last_seconds
        if per_pass is None or step is None or not step > 0:
            return 0.0
        return per_pass / step

    def after_step(self, timed: tuple[int, float] | None, batch: int,
                   drafted: tuple[int, int, float] | None = None,
                   pipelined: tuple[int, float] | None = None) -> tuple[float, float]:
        """Record a step's timed verify pass (`timed_pass`; None: nothing timed), its draft-model passes
        (`drafted_passes`) and its pipelined period (`pipelined_pass`), and return (cost per draft, fixed cost of
        drafting) for a batch of `batch` decoding sequences."""
        if timed is not None:
            self.observe(*timed)
        if drafted is not None:
            self.observe_draft(*drafted)
        if pipelined is not None:
            self.observe_pipelined(*pipelined)
        return self.cost_per_draft(batch), self.fixed_cost(batch)

    def measured_cost(self, batch: int) -> float | None:
        """The fit's cost per draft for a batch of `batch` decoding sequences, `b*B / T(B)` with `T(B)` the
        pipelined period when measured, else `a + b*B` (None before the fit): one drafted row's time in units of
        one sequence's share of a plain step."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise InvalidArgumentError(f"batch: {batch!r} must be an integer >= 0")
        if not self.fitted:
            return None
        rows_cost = self.seconds_per_row * max(1, batch)
        step = self._unit(batch)
        return rows_cost / step if step > 0 else None

    def cost_per_draft(self, batch: int) -> float:
        """What one drafted token costs a sequence in a batch of `batch` decoding sequences, in units of its share
        of a plain step: the measured cost blended with the prior by `confidence`; before the fit, the prior or the
        early estimate from the pipelined period (`early_cost`), whichever is larger."""
        measured = self.measured_cost(batch)
        if measured is None:
            early = self.early_cost(batch)
            rows = self.prior if early is None else max(self.prior, early)
        else:
            rows = self.confidence * measured + (1.0 - self.confidence) * self.prior
        return rows + self.draft_cost(batch)

    def early_cost(self, batch: int) -> float | None:
        """Before the fit: the cost per draft from the pipelined period `T(B)` and the latest verify sample of more
        rows than `batch`, taking the period as a plain pass's time, `((t - T) / (rows - B)) * B / T` (an upper
        bound: the verify pass also pays the pipelining it gave up). None without both."""
        step = self.pipelined_step(max(1, batch))
        if step is None or self._last_seconds is None or self._last_rows <= batch:
            return None
        per_row = max(0.0, self._last_seconds - step) / (self._last_rows - batch)
        return per_row * max(1, batch) / step


__all__ = ["PIPELINED_SAMPLES", "PLAIN_STEPS_TO_MEASURE", "PRIOR_COST_PER_DRAFT", "VerifyCostModel", "drafted_passes",
           "pipelined_pass", "timed_pass"]

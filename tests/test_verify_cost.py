"""The measured cost of a drafted row (engine/verify_cost.py): the `a + b*rows` fit, the cost per draft it gives a
batch, which steps are timed, and the adaptive draft length following the cost as it is fed."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.adaptive_draft import AdaptiveDraftLength
from cortexstream.engine.step_plan import ModelDraft, SampledToken, StepPlan, StepResult, WorkItem, WorkKind
from cortexstream.engine.verify_cost import (PRIOR_COST_PER_DRAFT, VerifyCostModel, drafted_passes, pipelined_pass,
                                             timed_pass)
from cortexstream.errors import InvalidArgumentError


def _feed(model: VerifyCostModel, a: float, b: float, rows: list[int], noise: float = 0.0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for r in rows:
        model.observe(r, (a + b * r) * (1.0 + noise * rng.standard_normal()))


def test_the_fit_recovers_a_and_b_from_noisy_samples():
    model = VerifyCostModel()
    rows = [int(r) for r in np.random.default_rng(1).integers(1, 41, size=300)]
    _feed(model, a=0.030, b=0.002, rows=rows, noise=0.02)
    assert model.fixed_seconds == pytest.approx(0.030, rel=0.15)
    assert model.seconds_per_row == pytest.approx(0.002, rel=0.1)
    assert model.predict(10) == pytest.approx(0.050, rel=0.05)


def test_the_prior_holds_until_two_row_counts_were_seen():
    model = VerifyCostModel()
    assert model.cost_per_draft(8) == PRIOR_COST_PER_DRAFT
    _feed(model, a=0.01, b=0.01, rows=[8] * 30)  # one row count: no slope to speak of
    assert not model.fitted and model.cost_per_draft(8) == PRIOR_COST_PER_DRAFT and model.predict(8) is None
    _feed(model, a=0.01, b=0.01, rows=[12, 16, 12, 16])
    assert model.fitted and 0 < model.confidence < 1
    assert model.seconds_per_row == pytest.approx(0.01, rel=1e-6)
    assert model.fixed_seconds == pytest.approx(0.01, rel=1e-6)


def test_cost_per_draft_is_small_when_weight_bound_and_near_one_when_rows_dominate():
    weight_bound = VerifyCostModel()
    _feed(weight_bound, a=0.020, b=0.0005, rows=[1, 2, 3, 5] * 10)  # a >> b
    assert weight_bound.measured_cost(1) == pytest.approx(0.0005 / 0.0205, rel=1e-3)
    assert weight_bound.cost_per_draft(1) < 0.06  # mostly measured: forty samples over four row counts
    compute_bound = VerifyCostModel()
    _feed(compute_bound, a=0.004, b=0.010, rows=[8, 12, 20, 40] * 10)  # b*B >> a at B = 8
    assert compute_bound.measured_cost(8) == pytest.approx(0.080 / 0.084, rel=1e-3)
    assert compute_bound.cost_per_draft(8) > 0.9
    assert compute_bound.cost_per_draft(1) < compute_bound.cost_per_draft(8)  # the same rows, a smaller batch
    assert compute_bound.cost_per_draft(0) == compute_bound.cost_per_draft(1)  # no batch yet: as one sequence


def test_few_samples_move_the_cost_part_of_the_way_and_forgotten_spread_returns_it_to_the_prior():
    model = VerifyCostModel()
    _feed(model, a=0.002, b=0.010, rows=[8, 9, 8, 9])  # two samples say rows are dear (first passes are not)
    measured = model.measured_cost(8)
    assert measured > 0.9 and PRIOR_COST_PER_DRAFT < model.cost_per_draft(8) < 0.5 * (measured + PRIOR_COST_PER_DRAFT)
    _feed(model, a=0.002, b=0.010, rows=[8, 12, 16, 24] * 10)
    assert model.cost_per_draft(8) > 0.9 and model.confidence > 0.99
    _feed(model, a=0.002, b=0.010, rows=[9] * 400)  # nothing drafts but one-token probes: the spread is forgotten
    assert model.measured_cost(8) == pytest.approx(measured, rel=1e-3)  # the slope kept
    assert model.cost_per_draft(8) == pytest.approx(PRIOR_COST_PER_DRAFT, abs=0.05)


def test_the_slope_is_kept_while_rows_hardly_vary_and_the_level_follows():
    model = VerifyCostModel()
    _feed(model, a=0.02, b=0.005, rows=[4, 8] * 20)
    assert model.seconds_per_row == pytest.approx(0.005, rel=1e-6)
    _feed(model, a=0.05, b=0.005, rows=[6] * 200)  # slower machine, every pass the same size
    # The level moved while the older samples still spread the rows (the slope shifts a little then), and the
    # slope was kept once they were forgotten: neither lost nor refitted from one row count.
    held = model.seconds_per_row
    assert held == pytest.approx(0.005, rel=0.15)
    assert model.predict(6) == pytest.approx(0.05 + 0.005 * 6, rel=1e-3)
    _feed(model, a=0.05, b=0.005, rows=[6] * 50)
    assert model.seconds_per_row == held


def test_forgetting_follows_a_change_of_regime():
    model = VerifyCostModel()
    _feed(model, a=0.02, b=0.0005, rows=[1, 3, 5] * 20)
    assert model.cost_per_draft(4) < 0.1
    _feed(model, a=0.002, b=0.010, rows=[4, 8, 12] * 40)  # the batch became compute-bound
    assert model.cost_per_draft(4) > 0.9


def test_a_stall_moves_the_fit_a_bounded_amount():
    model = VerifyCostModel()
    _feed(model, a=0.02, b=0.002, rows=[2, 6] * 20)
    model.observe(6, 30.0)  # the caller paused between steps: clipped to 4x the prediction, one of ~20 samples
    assert model.predict(6) < 0.032 * 1.5
    assert model.seconds_per_row < 0.002 * 3
    _feed(model, a=0.06, b=0.006, rows=[2, 6] * 40)  # a lasting change (3x) is followed all the same
    assert model.predict(6) == pytest.approx(0.096, rel=0.02)


@pytest.mark.parametrize("kwargs, names", [
    (dict(prior=1.5), "prior"), (dict(decay=1.0), "decay"), (dict(decay=0), "decay"),
    (dict(min_spread=0), "min_spread"), (dict(outlier=1.0), "outlier"), (dict(prior=True), "prior"),
    (dict(prior_strength=-1), "prior_strength"),
])
def test_bad_settings_are_refused_by_name(kwargs, names):
    with pytest.raises(InvalidArgumentError, match=names):
        VerifyCostModel(**kwargs)


def test_bad_samples_are_refused_by_name():
    model = VerifyCostModel()
    bad = [(0, 0.1, "rows"), (2.5, 0.1, "rows"), (2, 0.0, "seconds"), (2, float("nan"), "seconds")]
    for rows, seconds, name in bad:
        with pytest.raises(InvalidArgumentError, match=name):
            model.observe(rows, seconds)
    with pytest.raises(InvalidArgumentError, match="batch"):
        model.cost_per_draft(-1)
    with pytest.raises(InvalidArgumentError, match="batch"):
        model.measured_cost(True)


# --- which steps are timed ------------------------------------------------------------------------------------

def _item(rid: str, draft: tuple[int, ...] = (), model_draft: ModelDraft | None = None) -> WorkItem:
    return WorkItem(rid, WorkKind.DECODE, (5,), 10, 10, (0, 1, 2), sample=True, mixable=False, draft=draft,
                    model_draft=model_draft)


def test_a_verify_pass_is_timed_with_its_drafted_rows():
    plan = StepPlan(decode=(_item("a", draft=(1, 2, 3)), _item("b"), _item("c", model_draft=ModelDraft(2, 0, (5,)))))
    sampled = tuple(SampledToken(rid, None, None, ready=True) for rid in "abc")
    result = StepResult(sampled, accepted={"a": 1, "c": 0})
    assert timed_pass(plan, result, 0.25) == (4 + 1 + 3, 0.25)
    assert timed_pass(plan, result, None) is None
    assert timed_pass(StepPlan(), result, 0.25) is None  # no decode pass


def test_a_pipelined_pass_and_a_pass_with_prompt_chunks_are_not_timed():
    plan = StepPlan(decode=(_item("a"), _item("b")))
    in_flight = tuple(SampledToken(rid, None, None, ready=False) for rid in "ab")
    assert timed_pass(plan, StepResult(in_flight), 0.01) is None  # launched: computed during the next step
    assert timed_pass(plan, StepResult(in_flight, accepted={"a": 0}), 0.01) is None  # drafts dropped, launched
    # evaluated in the step, but its chunk tokens cost what prompt tokens do, not what drafted rows do
    assert timed_pass(plan, StepResult(in_flight, mixed_tokens=30), 0.2) is None
    read = tuple(SampledToken(rid, None, None, ready=True) for rid in "ab")
    assert timed_pass(plan, StepResult(read, accepted={"a": 1}, mixed_tokens=30), 0.2) is None
    assert timed_pass(plan, StepResult(read, accepted={"a": 1}), 0.2) == (2, 0.2)


def test_the_draft_models_passes_are_taken_out_of_the_verify_sample_and_kept_as_their_own():
    plan = StepPlan(decode=(_item("a", model_draft=ModelDraft(3, 0, (5,))), _item("b")))
    sampled = tuple(SampledToken(rid, None, None, ready=True) for rid in "ab")
    result = StepResult(sampled, accepted={"a": 2}, draft_seconds=0.15, draft_passes=3, draft_sequences=1)
    assert timed_pass(plan, result, 0.25) == (4 + 1, pytest.approx(0.10))
    assert drafted_passes(result) == (1, 3, 0.15)
    assert drafted_passes(StepResult(sampled)) is None
    # a step whose time is all draft passes (a clock this coarse) gives no verify sample
    assert timed_pass(plan, StepResult(sampled, accepted={"a": 0}, draft_seconds=0.3, draft_passes=3,
                                       draft_sequences=1), 0.25) is None


def test_draft_passes_add_their_share_of_a_plain_step_to_the_cost_per_draft():
    model = VerifyCostModel()
    _feed(model, a=0.010, b=0.004, rows=[4, 8, 16, 32] * 10)
    rows_only = model.cost_per_draft(8)
    assert model.draft_cost(8) == 0.0  # no draft pass measured yet
    model.observe_draft(8, 4, 0.4)  # the first pass of a shape is not a sample
    assert model.cost_per_draft(8) == rows_only
    for _ in range(5):
        model.observe_draft(8, 4, 4 * 0.021)  # 21 ms per pass of 8 drafting sequences
    plain_step = 0.010 + 0.004 * 8
    assert model.draft_cost(8) == pytest.approx(0.021 / plain_step)
    assert model.cost_per_draft(8) == pytest.approx(rows_only + 0.021 / plain_step)
    # the nearest measured count stands in for another batch
    assert model.draft_cost(6) == pytest.approx(0.021 / (0.010 + 0.004 * 6))
    # at 92% acceptance, drafting pays on the rows alone and not once the draft model's passes are counted
    draft = AdaptiveDraftLength(4, initial_rate=0.92, cost_per_draft=rows_only)
    assert draft.k > 0
    draft.set_cost_per_draft(model.cost_per_draft(8))
    assert draft.k == 0
    for args, name in [((0, 1, 0.1), "sequences"), ((1, 0, 0.1), "passes"), ((1, 1, 0.0), "seconds")]:
        with pytest.raises(InvalidArgumentError, match=name):
            model.observe_draft(*args)


def test_before_the_fit_the_latest_verify_sample_stands_in_for_a_plain_step():
    model = VerifyCostModel()
    model.observe(5, 0.3)
    model.observe(5, 0.2)  # one row count: not fitted
    model.observe_draft(1, 4, 0.4)
    model.observe_draft(1, 4, 0.4)
    assert not model.fitted and model.draft_cost(1) == pytest.approx(0.1 / 0.2)
    assert model.cost_per_draft(1) == pytest.approx(PRIOR_COST_PER_DRAFT + 0.5)


def test_only_a_plain_step_that_waited_for_the_pass_in_flight_times_the_pipelined_period():
    plan = StepPlan(decode=(_item("a"), _item("b")))
    in_flight = tuple(SampledToken(rid, None, None, ready=False) for rid in "ab")
    read = tuple(SampledToken(rid, None, None, ready=True) for rid in "ab")
    assert pipelined_pass(plan, StepResult(in_flight), 0.05, had_in_flight=True) == (2, 0.05)
    assert pipelined_pass(plan, StepResult(in_flight), 0.05, had_in_flight=False) is None  # launched from idle
    assert pipelined_pass(plan, StepResult(read), 0.05, had_in_flight=True) is None  # read within the step
    assert pipelined_pass(plan, StepResult(in_flight, mixed_tokens=8), 0.05, had_in_flight=True) is None
    drafted = StepPlan(decode=(_item("a", draft=(1,)), _item("b")))
    assert pipelined_pass(drafted, StepResult(in_flight), 0.05, had_in_flight=True) is None
    assert pipelined_pass(StepPlan(), StepResult(), 0.05, had_in_flight=True) is None


def test_the_pipelining_a_drafting_step_gives_up_is_a_fixed_cost_in_pipelined_units():
    model = VerifyCostModel()
    _feed(model, a=0.080, b=0.002, rows=[8, 12, 16, 24, 40] * 20)  # non-pipelined: 0.096 s at 8 rows
    assert model.fixed_cost(8) == 0.0 and model.pipelined_step(8) is None
    unpiped = model.measured_cost(8)
    for _ in range(10):
        model.observe_pipelined(8, 0.060)  # pipelined, the step's Python hides behind the pass
    assert model.pipelined_step(8) == pytest.approx(0.060)
    assert model.measured_cost(8) == pytest.approx(0.016 / 0.060, rel=1e-3)
    assert model.measured_cost(8) > unpiped
    assert model.fixed_cost(8) == pytest.approx(model.confidence * (0.096 / 0.060 - 1), rel=1e-3)
    # at 12% acceptance one drafted token seemed to pay on the rows alone; with the pipelining counted it does not
    draft = AdaptiveDraftLength(4, initial_rate=0.12)
    draft.set_cost_per_draft(0.1)
    assert draft.k == 1
    draft.set_cost_per_draft(*model.after_step(None, 8))
    assert draft.k == 0 and draft.fixed_cost > 0.5
    with pytest.raises(InvalidArgumentError, match="fixed_cost"):
        draft.set_cost_per_draft(0.1, -1.0)
    with pytest.raises(InvalidArgumentError, match="batch"):
        model.observe_pipelined(0, 0.1)


# --- the draft length follows the cost ------------------------------------------------------------------------

def test_k_drops_to_zero_when_rows_cost_a_step_and_rises_when_they_are_cheap():
    draft = AdaptiveDraftLength(8, initial_rate=0.6, cost_per_draft=0.05)
    assert draft.k > 0
    draft.set_cost_per_draft(0.95)
    assert draft.k == 0 and not draft.will_draft()
    draft.set_cost_per_draft(0.05)
    assert draft.k > 1 and draft.will_draft()
    with pytest.raises(InvalidArgumentError, match="cost_per_draft"):
        draft.set_cost_per_draft(-0.1)


def test_the_estimate_drives_k_through_the_batch_size():
    model = VerifyCostModel()
    _feed(model, a=0.010, b=0.004, rows=[4, 8, 16, 32] * 10)
    draft = AdaptiveDraftLength(4, initial_rate=0.5)
    draft.set_cost_per_draft(model.cost_per_draft(1))  # c = 0.004 / 0.014
    alone = draft.k
    draft.set_cost_per_draft(model.cost_per_draft(16))  # c = 0.064 / 0.074
    assert alone >= 1 and draft.k == 0


# --- in the engine --------------------------------------------------------------------------------------------

def _looping(seed: int, period: int = 6) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 250, size=period)] * 6


def test_the_engine_times_verify_passes_and_feeds_every_sequence_the_measured_cost(tiny):
    from cortexstream.engine.engine import Engine
    from tests.test_engine import collect

    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, speculative="ngram:k=4,n=2")
    for seed in range(3):  # finishing one after another: verify passes of several row counts
        engine.add_request(_looping(seed), max_tokens=30 + 15 * seed)
    estimate, checked = engine.scheduler.verify_cost, 0
    while engine.has_unfinished:
        collect(engine.step(), {})
        for seq in engine.scheduler.running:
            if estimate.fitted and seq.speculation is not None:
                expected = estimate.cost_per_draft(len(engine.scheduler.running))
                assert expected != PRIOR_COST_PER_DRAFT  # measured, at least in part
                assert seq.speculation.length.cost_per_draft == pytest.approx(expected)
                checked += 1
    assert estimate.samples > 0 and estimate.fitted and checked > 0
    assert estimate.fixed_seconds >= 0 and estimate.seconds_per_row >= 0


@pytest.mark.parametrize("prior", [0.0, 1.0])
def test_greedy_output_equals_plain_whatever_the_cost_says(tiny, prior):
    from cortexstream.engine.engine import Engine
    from tests.test_engine import run_all

    model, tokenizer = tiny
    prompts = [_looping(7), _looping(8, period=5), list(range(5, 40))]

    def run(speculative):
        engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, speculative=speculative)
        # prior 1.0: nothing drafts but the probes until passes were timed; 0.0: every sequence drafts k_max first
        engine.scheduler.verify_cost = VerifyCostModel(prior)
        ids = [engine.add_request(p, max_tokens=32) for p in prompts]
        results = run_all(engine)
        return [results[i]["tokens"] for i in ids], engine

    plain, _ = run(None)
    got, engine = run("ngram:k=4,n=2")
    assert got == plain
    assert engine.scheduler.num_verified > 0


def test_the_first_pass_of_a_shape_is_not_a_sample():
    """A shape's first pass allocates and builds what later ones reuse: a slow first 5-row verify must not make rows
    look dear (on SmolLM2 it set the cost to 0.6 at a batch of 1 and turned drafting off for good)."""
    model = VerifyCostModel()
    model.observe(5, 0.160)  # the first 5-row pass: slow
    model.observe(3, 0.050)  # the first 3-row pass
    assert model.samples == 0 and not model.fitted
    for rows in [3, 5, 2, 2, 4, 3, 5, 4] * 3:
        model.observe(rows, 0.035 + 0.006 * rows)
    assert model.seconds_per_row == pytest.approx(0.006, rel=1e-6)
    assert model.measured_cost(1) == pytest.approx(0.006 / 0.041, rel=1e-3)


# --- a batch pauses drafting to time its plain pipelined step ---------------------------------------------------

def test_a_batch_size_wants_plain_steps_until_its_pipelined_period_is_measured():
    from cortexstream.engine.verify_cost import PLAIN_STEPS_TO_MEASURE

    from cortexstream.engine.verify_cost import PIPELINED_SAMPLES

    model = VerifyCostModel()
    assert model.wants_plain_steps(8) and model.wants_plain_steps(1)
    model.observe_pipelined(8, 0.30)  # a shape's first sample is skipped
    for seconds in [0.19, 0.15, 0.15][:PIPELINED_SAMPLES]:
        assert model.wants_plain_steps(8)
        model.observe_pipelined(8, seconds)
    assert not model.wants_plain_steps(8)
    # a weighted mean: the first sample does not outweigh the later ones
    assert model.pipelined_step(8) == pytest.approx((0.95 ** 2 * 0.19 + 0.95 * 0.15 + 0.15) / (0.95 ** 2 + 0.95 + 1))
    assert not model.wants_plain_steps(7) and not model.wants_plain_steps(10)  # within a quarter of the batch
    assert model.wants_plain_steps(5) and model.wants_plain_steps(11)
    for _ in range(PLAIN_STEPS_TO_MEASURE):  # a size whose steps never pipeline stops asking after a few
        assert model.wants_plain_steps(3)
        model.plain_step_paused(3)
    assert not model.wants_plain_steps(3)
    with pytest.raises(InvalidArgumentError, match="batch"):
        model.wants_plain_steps(0)


def test_the_engine_times_plain_steps_of_a_new_batch_before_it_drafts(tiny):
    """A batch that would draft from its first decode step first runs plain pipelined steps until their period is
    measured, so the pipelining a drafting step gives up is counted from the start; then it drafts; greedy output
    is plain decoding's."""
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.verify_cost import PLAIN_STEPS_TO_MEASURE
    from tests.test_engine import collect, run_all

    model, tokenizer = tiny
    prompts = [_looping(3), _looping(4)]
    plain = Engine(model, tokenizer, kv_tokens=2048, block_size=4)
    plain_ids = [plain.add_request(p, max_tokens=40) for p in prompts]
    expected = run_all(plain)
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, speculative="ngram:k=4,n=2")
    engine.scheduler.verify_cost = VerifyCostModel(0.0)  # drafting looks free: every sequence would draft at once
    ids = [engine.add_request(p, max_tokens=40) for p in prompts]
    decode_steps, tokens = [], {}
    schedule = engine.scheduler.schedule

    def record():
        plan, ended = schedule()
        if plan.decode and not plan.prefill:
            decode_steps.append(any(item.draft for item in plan.decode))
        return plan, ended

    engine.scheduler.schedule = record
    while engine.has_unfinished:
        collect(engine.step(), tokens)
    assert [tokens[i]["tokens"] for i in ids] == [expected[i]["tokens"] for i in plain_ids]
    first_draft = decode_steps.index(True)
    assert 5 <= first_draft <= PLAIN_STEPS_TO_MEASURE  # from idle, a skipped first sample, PIPELINED_SAMPLES
    assert engine.scheduler.verify_cost.pipelined_step(2) is not None


def test_before_the_fit_a_measured_period_and_one_verify_sample_bound_the_cost():
    model = VerifyCostModel()
    assert model.early_cost(8) is None and model.cost_per_draft(8) == PRIOR_COST_PER_DRAFT
    model.observe(26, 0.5)  # a shape's first pass: not a sample
    model.observe(26, 0.40)  # one row count: no fit yet
    assert not model.fitted and model.early_cost(8) is None  # no period measured
    for seconds in (0.2, 0.16, 0.16, 0.16):
        model.observe_pipelined(8, seconds)
    per_row = (0.40 - 0.16) / (26 - 8)
    assert model.early_cost(8) == pytest.approx(per_row * 8 / 0.16)
    assert model.cost_per_draft(8) == pytest.approx(per_row * 8 / 0.16)  # above the prior: it rules
    assert model.early_cost(30) is None  # the sample has no more rows than the batch
    cheap = VerifyCostModel()
    cheap.observe(26, 0.2)
    cheap.observe(26, 0.17)
    for _ in range(4):
        cheap.observe_pipelined(8, 0.16)
    assert cheap.early_cost(8) < PRIOR_COST_PER_DRAFT and cheap.cost_per_draft(8) == PRIOR_COST_PER_DRAFT

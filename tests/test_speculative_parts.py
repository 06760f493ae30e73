"""The self-contained parts of speculative decoding: the `speculative=` string form, the prompt-lookup n-gram index
and the adaptive draft length. Verification (the samplers) is in test_speculative_sampling.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexstream.engine.adaptive_draft import AdaptiveDraftLength, expected_tokens
from cortexstream.engine.ngram_proposer import NgramIndex
from cortexstream.engine.speculative_config import SpeculativeConfig, SpeculativeMethod, parse_speculative
from cortexstream.errors import InvalidArgumentError

# --- the string form -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("ngram", SpeculativeConfig(SpeculativeMethod.NGRAM)),
    ("ngram:k=4,n=3", SpeculativeConfig(SpeculativeMethod.NGRAM, k=4, n=3)),
    (" NGRAM : k = 6 , adaptive = 0 ", SpeculativeConfig(SpeculativeMethod.NGRAM, k=6, adaptive=False)),
    ("ngram:n=1,k=16,adaptive=true", SpeculativeConfig(SpeculativeMethod.NGRAM, k=16, n=1)),
    ("draft:model=/models/small.gguf,k=4", SpeculativeConfig(SpeculativeMethod.DRAFT, model="/models/small.gguf")),
    ("draft:k=2,model=org/name=v2", SpeculativeConfig(SpeculativeMethod.DRAFT, k=2, model="org/name=v2")),
])
def test_good_forms_parse_and_their_text_round_trips(text, expected):
    config = parse_speculative(text)
    assert config == expected
    assert parse_speculative(config.text) == config
    assert parse_speculative(config) is config


def test_canonical_text():
    assert parse_speculative("ngram").text == "ngram:k=4,n=3"
    assert parse_speculative("ngram:adaptive=no,k=2").text == "ngram:k=2,n=3,adaptive=0"
    assert parse_speculative("draft:model=m").text == "draft:model=m,k=4"


@pytest.mark.parametrize("off", [None, "off", "none", " OFF "])
def test_off_forms_mean_no_speculation(off):
    assert parse_speculative(off) is None


def test_the_dataclass_takes_the_method_as_a_string_and_a_path():
    import pathlib

    config = SpeculativeConfig("draft", model=pathlib.Path("/m/x"))
    assert config.method is SpeculativeMethod.DRAFT and config.model == "/m/x"


@pytest.mark.parametrize("value, names", [
    ("ngram:k=0", "k=0"),
    ("ngram:k=17", "k=17"),
    ("ngram:k=four", "k='four'"),
    ("ngram:n=9", "n=9"),
    ("ngram:n=0", "n=0"),
    ("ngram:adaptive=maybe", "adaptive='maybe'"),
    ("ngram:q=1", "'q'"),
    ("ngram:model=x", "'model'"),
    ("draft:n=2,model=x", "'n'"),
    ("draft:k=4", "model"),
    ("draft:model=", "'model='"),
    ("ngram:k", "'k'"),
    ("ngram:k=2,k=3", "'k'"),
    ("ngram:k=2,,n=2", "empty item"),
    ("ngram:", "':'"),
    ("medusa:k=2", "'medusa'"),
    ("", "''"),
    (5, "int"),
])
def test_every_bad_form_names_speculative_the_bad_part_and_the_accepted_forms(value, names):
    with pytest.raises(InvalidArgumentError) as info:
        parse_speculative(value)
    message = str(info.value)
    assert message.startswith("speculative:")
    assert names in message
    assert "accepted forms: off | none | ngram" in message and "draft:model=PATH" in message


@pytest.mark.parametrize("kwargs, names", [
    (dict(method=SpeculativeMethod.NGRAM, model="x"), "model='x'"),
    (dict(method=SpeculativeMethod.DRAFT, model="x", n=2), "n=2"),
    (dict(method=SpeculativeMethod.DRAFT), "model"),
    (dict(method=SpeculativeMethod.DRAFT, model="a,b"), "model='a,b'"),
    (dict(method=SpeculativeMethod.NGRAM, k=True), "k=True"),
    (dict(method=SpeculativeMethod.NGRAM, adaptive=1), "adaptive=1"),
    (dict(method="beam"), "'beam'"),
])
def test_the_dataclass_validates_too(kwargs, names):
    with pytest.raises(InvalidArgumentError, match="^speculative:") as info:
        SpeculativeConfig(**kwargs)
    assert names in str(info.value)


# --- the n-gram index ------------------------------------------------------------------------------------------


def reference_propose(tokens: list[int], k: int, n: int) -> list[int]:
    """Brute force: the latest earlier occurrence of the last g tokens, g = n, n-1, ..., 1."""
    length = len(tokens)
    for g in range(min(n, length), 0, -1):
        tail = tokens[length - g:]
        for start in range(length - g - 1, -1, -1):
            if tokens[start:start + g] == tail:
                return tokens[start + g:start + g + k]
    return []


def test_matches_the_latest_earlier_occurrence():
    tokens = [7, 1, 2, 9, 9, 1, 2, 8, 8, 1, 2]
    index = NgramIndex.from_tokens(tokens, 3)
    assert index.match(2) == (5, 2)  # (1, 2) at 1 and at 5; the tail itself at 9 is not a match
    assert index.propose(3, 2) == [8, 8, 1]


def test_falls_back_to_shorter_grams():
    index = NgramIndex.from_tokens([5, 3, 4, 6, 0, 4], 3)  # (6, 0, 4) and (0, 4) never occurred before; 4 did
    assert index.match(3) == (2, 1)
    assert index.propose(2, 3) == [6, 0]
    assert NgramIndex.from_tokens([1, 2, 3], 3).propose(4, 3) == []  # 3 never occurred before
    assert NgramIndex.from_tokens([], 2).propose(4, 2) == []


def test_never_proposes_past_the_end_nor_the_current_position():
    index = NgramIndex.from_tokens([4, 4, 4], 3)
    # (4, 4) occurs at 0 with the continuation [4]; the tail at 1 is never its own match.
    assert index.propose(8, 2) == [4]
    index.extend([4])
    assert index.propose(8, 3) == [4]
    assert index.propose(0, 3) == []
    index = NgramIndex.from_tokens([1, 2, 3, 1, 2], 2)
    assert index.propose(10, 2) == [3, 1, 2]


def test_extend_records_a_gram_once_its_next_token_exists():
    index = NgramIndex.from_tokens([3, 5], 2)
    assert index.propose(4, 2) == []
    index.extend([3])  # (3,) at 0 has the continuation 5
    assert index.propose(4, 2) == [5, 3]


def test_bad_arguments_are_refused():
    index = NgramIndex.from_tokens([1, 2, 1], 3)
    for call, name in [(lambda: index.propose(2, 4), "n"), (lambda: index.propose(-1, 2), "k"),
                       (lambda: index.truncate(4), "length"), (lambda: NgramIndex(0), "n_max")]:
        with pytest.raises(InvalidArgumentError, match=f"^{name}:"):
            call()


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), n_max=st.integers(1, 4), k=st.integers(0, 6))
def test_propose_equals_a_brute_force_reference(tokens, n_max, k):
    index = NgramIndex.from_tokens(tokens, n_max)
    for n in range(1, n_max + 1):
        assert index.propose(k, n) == reference_propose(tokens, k, n)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.lists(st.integers(0, 2), max_size=8), st.integers(0, 40)), max_size=25),
       n_max=st.integers(1, 4))
def test_incremental_extend_and_truncate_equal_building_from_scratch(ops, n_max):
    index = NgramIndex(n_max)
    tokens: list[int] = []
    for op in ops:
        if isinstance(op, list):
            index.extend(op)
            tokens += op
        else:
            length = min(op, len(tokens))
            index.truncate(length)
            del tokens[length:]
        fresh = NgramIndex.from_tokens(tokens, n_max)
        assert index.tokens == tuple(tokens)
        for n in range(1, n_max + 1):
            assert index.match(n) == fresh.match(n)
            assert index.propose(5, n) == fresh.propose(5, n) == reference_propose(tokens, 5, n)


# --- adaptive k ------------------------------------------------------------------------------------------------


def run(draft: AdaptiveDraftLength, steps: int, hit: bool) -> list[int]:
    """Steps of a drafter that always (hit) or never has its tokens accepted; the ks it was asked for."""
    ks = []
    for _ in range(steps):
        k = draft.next_k()
        ks.append(k)
        if k:
            draft.record(k, k if hit else 0)
    return ks


def test_the_cost_model_picks_the_k_that_pays_most():
    # E(k)/(1 + 0.1k) at a = 0.5: k=1 1.364, k=2 1.458, k=3 1.442 -> 2. At a = 0.8 the peak is k=6 (2.469 vs
    # 2.459 at 5 and 2.450 at 7). At a = 0.05 < c no k beats plain decoding.
    assert AdaptiveDraftLength(8, initial_rate=0.5).k == 2
    assert AdaptiveDraftLength(8, initial_rate=0.8).k == 6
    assert AdaptiveDraftLength(8, initial_rate=0.05).k == 0
    assert AdaptiveDraftLength(8, initial_rate=1.0).k == 8
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0


def test_a_drafter_that_never_hits_goes_to_plain_decoding():
    draft = AdaptiveDraftLength(8)
    ks = run(draft, 40, hit=False)
    assert ks[0] == 6 and draft.k == 0
    assert draft.acceptance_rate < draft.cost_per_draft
    assert ks[ks.index(0):][:15] == [0] * 15  # once at 0 it stays there until the probe


def test_a_drafter_that_always_hits_climbs_to_k_max():
    draft = AdaptiveDraftLength(16, initial_rate=0.3)
    ks = run(draft, 40, hit=True)
    assert ks[0] < 16 and ks[-1] == 16
    assert ks == sorted(ks)


def test_from_zero_it_probes_backs_off_and_recovers():
    draft = AdaptiveDraftLength(8, probe_every=5, max_backoff=4)
    ks = run(draft, 200, hit=False)
    assert draft.k == 0
    probes = [i for i, k in enumerate(ks) if k == 1 and ks[i - 1] == 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [10, 20, 20] and set(gaps[2:]) == {20}  # each failed probe doubles the wait, up to 5 * 4
    while run(draft, 1, hit=False) != [1]:  # to just after a probe
        pass
    ks = run(draft, 60, hit=True)
    assert ks[:19] == [0] * 19 and ks[19] == 1 and ks[-1] == 8  # the probe that hits brings k back
    assert draft.probe_interval == 5  # and resets the wait


def test_empty_proposals_change_nothing_and_count_as_a_probe_made():
    draft = AdaptiveDraftLength(8, initial_rate=0.6)
    before = (draft.k, draft.acceptance_rate)
    for _ in range(50):
        draft.next_k()
        draft.record(0, 0)
    assert (draft.k, draft.acceptance_rate) == before
    idle = AdaptiveDraftLength(8, initial_rate=0.0, probe_every=3)
    assert [idle.next_k() for _ in range(3)] == [0, 0, 1]
    idle.record(0, 0)  # the probe found nothing to propose: made, the next one waits a whole interval
    assert [idle.next_k() for _ in range(3)] == [0, 0, 1] and idle.probe_interval == 3
    idle.record(1, 0)
    assert [idle.next_k() for _ in range(6)] == [0, 0, 0, 0, 0, 1]  # a failed probe: twice the wait


def test_with_the_engine_clock_idle_sequences_probe_in_the_same_steps():
    """Sequences that reach k = 0 at different steps probe on the clock's multiples of their interval (after at
    least half an interval idle), so a batch gives up its pipelined decode once per interval, not once per sequence."""
    drafts = [AdaptiveDraftLength(4, initial_rate=0.0, probe_every=8) for _ in range(3)]
    probes: dict[int, list[int]] = {}
    for clock in range(1, 200):
        for i, draft in enumerate(drafts):
            if clock < 3 * i:  # each starts idling at its own step
                continue
            assert draft.will_draft(clock) == (draft.k > 0 or clock % draft.probe_interval == 0 and clock > 3 * i + 3)
            if draft.next_k(clock):
                probes.setdefault(clock, []).append(i)
                draft.record(1, 0)
    steps = sorted(probes)
    assert all(step % 8 == 0 for step in steps)
    assert all(probes[step] == [0, 1, 2] for step in steps[1:])  # in lockstep once all have backed off alike
    assert len(steps) <= 6  # 8, 16, 32, 64, 128 (backing off to 8 * 8 = 64)


def test_a_draft_is_one_first_token_trial_and_continuation_trials_up_to_the_first_rejection():
    draft = AdaptiveDraftLength(4, initial_rate=0.5, prior_trials=2.0, decay=0.5)
    draft.record(4, 2)  # first token accepted; later: one success, one failure; the fourth was never tested
    assert draft.acceptance_rate == pytest.approx((0.5 * 1.0 + 1) / (0.5 * 2.0 + 1))  # after a rejection
    assert draft.continuation_rate == pytest.approx((0.5 * 1.0 + 1) / (0.5 * 2.0 + 2))
    draft.record(3, 3)  # all accepted: a first-token success (state: after a rejection), two later successes
    assert draft.continuation_rate == pytest.approx((0.5 * 1.5 + 2) / (0.5 * 3.0 + 2))
    assert draft.acceptance_rate == pytest.approx(0.5)  # now after a full acceptance: that state's prior
    draft.record(2, 0)  # the first token rejected (a trial of the full-acceptance state): no continuation trial
    assert draft.continuation_rate == pytest.approx((0.5 * 1.5 + 2) / (0.5 * 3.0 + 2))
    assert draft.acceptance_rate == pytest.approx(1.75 / 2)  # after a rejection again: that state's rate
    draft.record(1, 1)
    assert draft.acceptance_rate == pytest.approx(0.5 * 1.0 / (0.5 * 2.0 + 1))  # the failure above


def test_expected_tokens_with_a_weaker_first_token():
    assert expected_tokens(0.9, 3, first=0.5) == pytest.approx(1 + 0.5 * (1 + 0.9 + 0.81))
    assert expected_tokens(1.0, 3, first=0.5) == pytest.approx(2.5)
    assert expected_tokens(0.6, 4, first=0.6) == pytest.approx(expected_tokens(0.6, 4))


def test_a_copying_stretch_drafts_long_and_a_rejection_drafts_short():
    """The first token's rate is kept per state: after a fully accepted draft a copy usually goes on, after a
    rejection the next proposal often misses. Same history of rates, different k by state."""
    draft = AdaptiveDraftLength(8, cost_per_draft=0.6, initial_rate=0.6)
    for _ in range(30):  # after a rejection: one more miss, then a hit starts a stretch of five full acceptances
        draft.record(1, 0)
        draft.record(1, 1)
        for _ in range(4):
            draft.record(4, 4)
        draft.record(4, 0)
    after_miss = draft.k
    assert draft.acceptance_rate == pytest.approx(0.5, abs=0.05)
    draft.record(1, 1)
    after_hit = draft.k
    assert draft.acceptance_rate == pytest.approx(0.8, abs=0.05) and draft.continuation_rate > 0.99
    assert after_miss == 0 and after_hit == 8


def test_not_adaptive_always_drafts_k_max():
    draft = AdaptiveDraftLength(5, adaptive=False)
    assert run(draft, 20, hit=False) == [5] * 20


@pytest.mark.parametrize("kwargs, name", [
    (dict(k_max=0), "k_max"), (dict(k_max=4, adaptive=1), "adaptive"), (dict(k_max=4, decay=1.0), "decay"),
    (dict(k_max=4, cost_per_draft=-0.1), "cost_per_draft"), (dict(k_max=4, probe_every=0), "probe_every"),
    (dict(k_max=4, initial_rate=1.5), "initial_rate"), (dict(k_max=4, prior_trials=0), "prior_trials"),
])
def test_bad_settings_are_refused(kwargs, name):
    with pytest.raises(InvalidArgumentError, match=f"^{name}:"):
        AdaptiveDraftLength(**kwargs)


def test_bad_records_are_refused():
    draft = AdaptiveDraftLength(4)
    with pytest.raises(InvalidArgumentError, match="^accepted:"):
        draft.record(2, 3)
    with pytest.raises(InvalidArgumentError, match="^proposed:"):
        draft.record(-1, 0)

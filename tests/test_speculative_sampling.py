"""Verification of drafted tokens: greedy equals plain greedy decoding, the rejection sampler's output follows the
target's distribution, and `target_logprobs` is what mlx-lm's sampler draws from."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.speculative_sampling import target_logprobs, verify_greedy, verify_sampled
from cortexstream.errors import InvalidArgumentError

# Chi-square critical value for 7 degrees of freedom (V = 8) at significance 0.001.
CHI2_CRITICAL_DF7 = 24.322
V = 8


def chi_square(samples: list[int] | np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(np.asarray(samples, dtype=np.int64), minlength=len(probs))
    expected = probs * counts.sum()
    assert expected.min() >= 5, "too few expected counts for a chi-square test"
    return float(((counts - expected) ** 2 / expected).sum())


def log_rows(rows: list[list[float]]) -> mx.array:
    probs = np.asarray(rows, dtype=np.float64)
    probs /= probs.sum(axis=-1, keepdims=True)
    return mx.array(np.log(probs).astype(np.float32))


# --- greedy ----------------------------------------------------------------------------------------------------


def plain_greedy(logits: np.ndarray, draft: list[int]) -> list[int]:
    """One token at a time: the argmax is emitted; decoding continues past a position only if the draft had
    the same token there (the next logits row is then the one the target computed after it)."""
    out = []
    for i, row in enumerate(logits):
        token = int(np.argmax(row))
        out.append(token)
        if i == len(draft) or draft[i] != token:
            break
    return out


def test_verify_greedy_equals_step_by_step_argmax():
    rng = np.random.default_rng(0)
    accepted_counts = set()
    for _ in range(300):
        k = int(rng.integers(0, 7))
        logits = rng.normal(size=(k + 1, 6)).astype(np.float32)
        best = logits.argmax(axis=-1)
        # Drafts that agree with the target for a random prefix, then random tokens.
        agree = int(rng.integers(0, k + 1))
        draft = [int(t) for t in best[:agree]] + [int(t) for t in rng.integers(0, 6, size=k - agree)]
        got = verify_greedy(mx.array(logits), draft)
        assert got == plain_greedy(logits, draft)
        assert all(isinstance(t, int) for t in got)
        accepted_counts.add(len(got) - 1)
    assert accepted_counts == set(range(7))


def test_verify_greedy_all_and_none_accepted():
    logits = mx.array(np.eye(5, dtype=np.float32)[[3, 1, 4, 0]])  # argmaxes 3, 1, 4, 0
    assert verify_greedy(logits, [3, 1, 4]) == [3, 1, 4, 0]  # every draft accepted, plus the bonus token
    assert verify_greedy(logits, [2, 1, 4]) == [3]  # the first is wrong: only the correction
    assert verify_greedy(logits, [3, 1, 2]) == [3, 1, 4]
    assert verify_greedy(logits[:1], []) == [3]


def test_bad_shapes_and_tokens_are_refused():
    logits = mx.zeros((3, 5))
    with pytest.raises(InvalidArgumentError, match="^logits:"):
        verify_greedy(logits, [1])
    with pytest.raises(InvalidArgumentError, match="^draft:"):
        verify_greedy(logits, [1, 5])
    with pytest.raises(InvalidArgumentError, match="^draft_logprobs:"):
        verify_sampled(logits, [1, 2], mx.zeros((2, 4)))
    with pytest.raises(InvalidArgumentError, match="^target:"):
        verify_sampled(logits, [1], None)


# --- rejection sampling ----------------------------------------------------------------------------------------

P = [[0.30, 0.05, 0.20, 0.10, 0.02, 0.13, 0.15, 0.05],
     [0.08, 0.45, 0.04, 0.12, 0.06, 0.10, 0.05, 0.10],
     [0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10]]
Q = [[0.05, 0.30, 0.05, 0.30, 0.05, 0.05, 0.15, 0.05],
     [0.10, 0.20, 0.30, 0.05, 0.05, 0.20, 0.05, 0.05]]
TRIALS = 20_000


def emitted(target: mx.array, drafts: np.ndarray, draft_logprobs: mx.array | None) -> list[list[int]]:
    keys = mx.random.split(mx.random.key(1234), len(drafts))
    return [verify_sampled(target, [int(t) for t in draft], draft_logprobs, keys[i])
            for i, draft in enumerate(drafts)]


def check_follows_target(outputs: list[list[int]], drafts: np.ndarray, p: np.ndarray) -> None:
    """Token j of the output (given the drafts before it were accepted) must follow p_j."""
    for j in range(len(p)):
        reached = [out[j] for out, draft in zip(outputs, drafts) if len(out) > j
                   and out[:j] == [int(t) for t in draft[:j]]]
        statistic = chi_square(reached, p[j])
        assert statistic < CHI2_CRITICAL_DF7, (j, len(reached), statistic)


def test_a_deterministic_draft_leaves_the_target_distribution():
    p = np.asarray(P) / np.sum(P, axis=-1, keepdims=True)
    draft = np.array([0, 1])  # the most likely tokens, so later positions are reached often enough
    drafts = np.tile(draft, (TRIALS, 1))
    outputs = emitted(log_rows(P), drafts, None)
    check_follows_target(outputs, drafts, p)
    # The test tells a common mistake apart: resampling from p itself (not p without the draft) at a rejection.
    first = [out[0] for out in outputs]
    wrong = p[0] * (1 - p[0][0])
    wrong[0] += p[0][0]
    assert chi_square(first, wrong) > 10 * CHI2_CRITICAL_DF7


def test_a_draft_distribution_leaves_the_target_distribution():
    p = np.asarray(P) / np.sum(P, axis=-1, keepdims=True)
    q = np.asarray(Q) / np.sum(Q, axis=-1, keepdims=True)
    rng = np.random.default_rng(5)
    drafts = np.stack([rng.choice(V, size=TRIALS, p=q[i]) for i in range(2)], axis=1)  # d_i drawn from q_i
    outputs = emitted(log_rows(P), drafts, log_rows(Q))
    check_follows_target(outputs, drafts, p)
    # The drafts alone follow q, far from p: the statistic sees that difference.
    assert chi_square(drafts[:, 0], p[0]) > 10 * CHI2_CRITICAL_DF7
    accepted_all = sum(len(out) == 3 for out in outputs) / TRIALS
    assert 0.1 < accepted_all < 0.9


def test_a_seeded_key_repeats_and_no_key_uses_the_global_state():
    target, draft_logprobs = log_rows(P), log_rows(Q)
    runs = [[verify_sampled(target, [3, 2], draft_logprobs, mx.random.key(seed)) for seed in range(50)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(out) for out in runs[0]}) > 5
    mx.random.seed(3)
    first = [verify_sampled(target, [3, 2], None) for _ in range(20)]
    mx.random.seed(3)
    assert [verify_sampled(target, [3, 2], None) for _ in range(20)] == first


def test_a_point_mass_target_verifies_as_greedy():
    rng = np.random.default_rng(2)
    greedy = SamplingParams()
    for _ in range(50):
        logits = mx.array(rng.normal(size=(4, 6)).astype(np.float32))
        best = np.argmax(np.array(logits), axis=-1)
        draft = [int(best[0]), int(best[1]) if rng.random() < 0.5 else int(rng.integers(0, 6)), int(best[2])]
        point = target_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), greedy)
        assert verify_sampled(point, draft, None, mx.random.key(0)) == verify_greedy(logits, draft)


# --- target_logprobs against mlx-lm's sampler ------------------------------------------------------------------

PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.6, top_p=0.9, min_p=0.05, top_k=3),
    SamplingParams(temperature=1.0, top_k=32),  # not below the vocabulary: keeps every token
]


def random_logprobs(rows: int, vocab: int, seed: int) -> mx.array:
    logits = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 2
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def reference_support(logprobs: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """Which tokens top-p, min-p and top-k keep, computed directly in float64."""
    probs = np.exp(logprobs.astype(np.float64))
    keep = np.ones_like(probs, dtype=bool)
    if sampling.top_p < 1.0:
        more_likely = probs[:, None, :] > probs[:, :, None]  # [row, token, other]: other beats token
        above = (more_likely * probs[:, None, :]).sum(axis=-1)
        keep &= above < sampling.top_p * probs.sum(axis=-1, keepdims=True)
    if sampling.min_p > 0:
        keep &= probs >= probs.max(axis=-1, keepdims=True) * sampling.min_p
    if 0 < sampling.top_k < probs.shape[-1]:
        rank = np.argsort(np.argsort(-probs, axis=-1), axis=-1)
        keep &= rank < sampling.top_k
    return keep


@pytest.mark.parametrize("sampling", PARAMS)
def test_target_logprobs_keeps_the_tokens_mlx_lm_can_draw(sampling):
    logprobs = random_logprobs(200, 32, seed=11)
    target = target_logprobs(logprobs, sampling)
    assert np.array_equal(np.isfinite(np.array(target)), reference_support(np.array(logprobs), sampling))
    assert np.allclose(np.array(mx.logsumexp(target, axis=-1)), 0.0, atol=1e-5)


@pytest.mark.parametrize("sampling", PARAMS)
def test_target_logprobs_is_what_mlx_lm_samples_from(sampling):
    # Both draw with Gumbel noise from the same key: equal samples row for row at the same seed.
    logprobs = random_logprobs(4000, 32, seed=12)
    target = target_logprobs(logprobs, sampling)
    mx.random.seed(7)
    theirs = sampling.make_sampler()(logprobs)
    mx.random.seed(7)
    ours = mx.random.categorical(target)
    assert np.array_equal(np.array(theirs), np.array(ours))
    # And the frequencies of mlx-lm's draws from one row follow exp(target).
    row = mx.repeat(random_logprobs(1, V, seed=13), 20_000, axis=0)
    mx.random.seed(8)
    draws = np.array(sampling.make_sampler()(row))
    probs = np.exp(np.array(target_logprobs(row[:1], sampling), dtype=np.float64))[0]
    seen = probs > 0
    assert set(np.unique(draws)) <= set(np.flatnonzero(seen))
    if seen.sum() > 1:
        counts = np.bincount(draws, minlength=V)[seen]
        expected = probs[seen] / probs[seen].sum() * len(draws)
        statistic = float(((counts - expected) ** 2 / expected).sum())
        critical = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}[int(seen.sum()) - 1]
        assert statistic < critical  # chi-square at significance 0.001 for seen - 1 degrees of freedom


def test_target_logprobs_of_greedy_is_the_argmax():
    logprobs = random_logprobs(10, 16, seed=3)
    target = np.array(target_logprobs(logprobs, SamplingParams()))
    best = np.argmax(np.array(logprobs), axis=-1)
    assert np.array_equal(np.argmax(target, axis=-1), best)
    assert (np.isfinite(target).sum(axis=-1) == 1).all() and np.allclose(target.max(axis=-1), 0.0)

"""Verifying drafted tokens against the target model's logits, exactly.

Greedy: a drafted token is accepted while it equals the target's argmax at its position; the first mismatch is
replaced by the argmax (the correction), and when all match the argmax after the last one is the bonus token. The
result is token for token what plain greedy decoding gives.

Sampled: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023). With p_i the target's
distribution at drafted position i (from `target_logprobs`, the distribution the engine's sampler draws from) and
q_i the drafter's, token d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a
token is drawn from normalize(max(p_i - q_i, 0)) and verification stops; when all are accepted a bonus token is
drawn from p_k. Every emitted token then follows the target's distribution. A deterministic proposer (prompt
lookup) has q_i one-hot on d_i: acceptance with probability p_i(d_i), and on rejection a draw from p_i without d_i.
The drafter's q must be made with the same `target_logprobs` filters (top-p / min-p / top-k, temperature) as p.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from cortexstream.engine.sampling import SamplingParams
from cortexstream.errors import InvalidArgumentError


def target_logprobs(logprobs: mx.array, sampling: SamplingParams) -> mx.array:
    """The normalized log-probabilities `[m, V]` the engine's sampler draws each row's token from, given the
    log-probabilities `[m, V]` it receives (after logits processors and any grammar mask).

    Mirrors mlx-lm's `make_sampler` as `SamplingParams.make_sampler` builds it: top-p (when 0 < top_p < 1), then
    min-p (when min_p != 0), then top-k (only when it removes something, `SamplingParams.top_k_filters`), each on
    the log-probabilities and with mlx-lm's own functions, then the temperature scaling `categorical_sampling`
    applies (`x * (1 / temp)`). Filtered tokens are -inf. Greedy sampling (temperature 0) is a point mass on the
    argmax of `logprobs` (a greedy step should be verified with `verify_greedy` on the logits instead).
    """
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if logprobs.ndim != 2:
        raise InvalidArgumentError(f"logprobs: expected shape [m, V], got {tuple(logprobs.shape)}")
    vocab = logprobs.shape[-1]
    if sampling.greedy:
        best = mx.argmax(logprobs, axis=-1, keepdims=True)
        hit = mx.arange(vocab)[None, :] == best
        return mx.where(hit, mx.array(0.0, logprobs.dtype), mx.array(-mx.inf, logprobs.dtype))
    x = logprobs
    if 0 < sampling.top_p < 1.0:
        x = apply_top_p(x, sampling.top_p)
    if sampling.min_p != 0.0:
        x = apply_min_p(x, sampling.min_p, 1)
    if sampling.top_k_filters(vocab):
        x = apply_top_k(x, sampling.top_k)
    x = x * (1.0 / sampling.temperature)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _check_draft(draft: Sequence[int], rows: int, name: str, vocab: int) -> list[int]:
    tokens = [int(t) for t in draft]
    if rows != len(tokens) + 1:
        raise InvalidArgumentError(f"{name}: {rows} rows for {len(tokens)} drafted tokens, expected "
                                   f"{len(tokens) + 1} (one per drafted token plus the one after them)")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError(f"draft: token ids {bad} are outside the vocabulary of {vocab}")
    return tokens


def verify_greedy(logits: mx.array, draft: Sequence[int]) -> list[int]:
    """The accepted drafted tokens followed by the target's own next token, from the target's logits `[k+1, V]`
    at the k drafted positions and the one after them."""
    if logits.ndim != 2:
        raise InvalidArgumentError(f"logits: expected shape [k+1, V], got {tuple(logits.shape)}")
    tokens = _check_draft(draft, logits.shape[0], "logits", logits.shape[-1])
    best = mx.argmax(logits, axis=-1).tolist()
    out: list[int] = []
    for drafted, target in zip(tokens, best):
        if drafted != target:
            break
        out.append(drafted)
    out.append(int(best[len(out)]))
    return out


def verify_sampled(target: mx.array, draft: Sequence[int], draft_logprobs: mx.array | None,
                   key: mx.array | None = None) -> list[int]:
    """The accepted drafted tokens followed by one token drawn by rejection sampling (a correction or the bonus).

    `target`: `[k+1, V]` log-probabilities from `target_logprobs`. `draft_logprobs`: the drafter's `[k, V]`
    log-probabilities (same filters), or None for a deterministic proposer. `key`: an `mx.random` key, split
    into one key per kind of draw (acceptance tests, replacement tokens), so a seeded run repeats; None draws
    from MLX's global random state. Every draw is made up front in one evaluation, and the emitted prefix is
    read from them.
    """
    if target.ndim != 2:
        raise InvalidArgumentError(f"target: expected shape [k+1, V], got {tuple(target.shape)}")
    vocab = target.shape[-1]
    tokens = _check_draft(draft, target.shape[0], "target", vocab)
    k = len(tokens)
    if draft_logprobs is not None and tuple(draft_logprobs.shape) != (k, vocab):
        raise InvalidArgumentError(f"draft_logprobs: expected shape {(k, vocab)}, got {tuple(draft_logprobs.shape)}")
    accept_key, token_key = mx.random.split(key) if key is not None else (None, None)
    logp = target.astype(mx.float32)
    if k == 0:
        return [int(mx.random.categorical(logp[0], key=token_key).item())]
    ids = mx.array(tokens, dtype=mx.int32)
    p = mx.exp(logp[:k])
    if draft_logprobs is None:
        q = (mx.arange(vocab)[None, :] == ids[:, None]).astype(mx.float32)
    else:
        q = mx.exp(draft_logprobs.astype(mx.float32))
    p_d = mx.take_along_axis(p, ids[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, ids[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=accept_key)
    accepted = u * q_d < p_d  # u < p/q: probability min(1, p/q) (a q of 0 accepts when p > 0)
    residual = mx.maximum(p - q, 0.0)
    # A rejection implies p_d < q_d, so the residual has mass; a row left empty by rounding falls back to p.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    rows = mx.concatenate([mx.log(residual), logp[k:]], axis=0)
    replacements = mx.random.categorical(rows, key=token_key)
    mx.eval(accepted, replacements)
    flags, drawn = accepted.tolist(), replacements.tolist()
    out: list[int] = []
    for token, ok in zip(tokens, flags):
        if not ok:
            break
        out.append(token)
    out.append(int(drawn[len(out)]))
    return out

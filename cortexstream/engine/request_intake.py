"""A request's arguments checked and turned into a `Sequence` (what `Engine.add_request` queues).

Everything a caller can get wrong is refused here, before anything is queued, with an error naming the argument:
the sampling parameters, a grammar that cannot be enforced, a KV policy string (or one that reconstructs its prompt,
KVzip, with a prompt cache), a sampler that is not callable, a request id in use, a prompt cache, a speculative
decoding setting. A KVzip request gets its reconstruction plan, its prompt from the engine's tokenizer. A seeded
sampled request gets its own seeded sampler, so its output does not depend on what else runs.
"""

from __future__ import annotations

from typing import Any, Callable

from cortexstream.engine.bound_cache import BoundCache
from cortexstream.engine.prompt import prompt_to_tokens
from cortexstream.engine.reconstruction_plan import ReconstructionPlan
from cortexstream.engine.reconstruction_prompt import reconstruction_prompt
from cortexstream.engine.sampling import SamplingParams, sampling_from_kwargs
from cortexstream.engine.seeded import seeded_sampler
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.speculation import SpeculationState
from cortexstream.engine.speculative_config import SpeculativeMethod, parse_speculative
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.parsing import parse_policy


def resolve_sampling(sampling: SamplingParams | None, sampling_kwargs: dict[str, Any]) -> SamplingParams:
    if sampling is None:
        return sampling_from_kwargs(**sampling_kwargs)
    if sampling_kwargs:
        raise InvalidArgumentError(f"add_request: pass either sampling= or {sorted(sampling_kwargs)}, not both")
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgumentError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
    return sampling


def make_sequence(engine: Any, prompt: Any, sampling: SamplingParams, *, kv_policy: Any, tenant: str | None,
                  request_id: str | None, prompt_cache: list[Any] | None, sampler: Any, speculative: Any,
                  in_use: Callable[[str], bool]) -> Sequence:
    """The sequence of one request to `engine` (its tokenizer, grammars, model and defaults; typed Any: this
    module must not import engine.py). `speculative` None takes the engine's default."""
    tokens = prompt_to_tokens(engine.tokenizer, prompt)
    if sampling.grammar is not None:  # refused here, before queueing, if it cannot be enforced
        engine.grammars.constraint(sampling.grammar)
    policy = engine.kv_policy if kv_policy is None else parse_policy(kv_policy)
    if sampler is not None and not callable(sampler):
        raise InvalidArgumentError(f"sampler: expected a callable logprobs -> token, got {type(sampler).__name__}")
    if request_id is not None and in_use(request_id):
        raise InvalidArgumentError(f"request_id: '{request_id}' is already in use")
    config = engine.speculative if speculative is None else parse_speculative(speculative)
    if config is not None and config.method is SpeculativeMethod.DRAFT:
        drafter = engine.runner.drafter
        if drafter is None or drafter.source != str(config.model):
            loaded = "none" if drafter is None else drafter.source
            raise InvalidArgumentError(f"speculative: {config.text!r} names a draft model this engine has not "
                                       f"loaded (loaded: {loaded}); start the engine or server with it as its "
                                       "default speculation")
    ids = {} if request_id is None else {"request_id": request_id}
    if sampler is None and sampling.seed is not None and not sampling.greedy:  # repeatable whatever else runs
        sampler = seeded_sampler(sampling, sampling.seed)
    if prompt_cache is not None and policy.reconstructs:
        raise InvalidArgumentError(f"kv_policy: {policy.describe()!r} reconstructs the prompt between engine "
                                   "steps, which a caller's prompt_cache does not take part in; use it without "
                                   "prompt_cache (the engine's own KV)")
    if prompt_cache is not None:
        bound = BoundCache.bind(prompt_cache, engine.model, None if kv_policy is None else policy,
                                len(tokens) + sampling.max_tokens, prompt_tokens=len(tokens))
        return Sequence(tokens, sampling, tenant=tenant, bound_cache=bound, kv_from_tokens=False, sampler=sampler,
                        **ids)
    seq = Sequence(tokens, sampling, tenant=tenant, kv_policy=policy, sampler=sampler, **ids)
    if policy.reconstructs:  # KVzip: the model repeats the prompt before it decodes (engine/reconstruction_plan)
        prefix = reconstruction_prompt(engine.tokenizer).prefix
        step = engine.scheduler.config.prefill_step_size
        if len(prefix) >= step:
            raise InvalidArgumentError(f"kv_policy: {policy.describe()!r} repeats the prompt after a "
                                       f"{len(prefix)}-token prefix, which leaves no room in a pass of "
                                       f"prefill_step_size {step} tokens; raise prefill_step_size")
        seq.reconstruction = ReconstructionPlan(prefix, policy.chunk)
    if config is not None and speculates(seq):
        seq.speculation = SpeculationState(config)
    return seq


def speculates(seq: Sequence) -> bool:
    """Whether drafted tokens can be verified for this request: on the arena, no evicting policy, and a next-token
    distribution that does not depend on the drafted tokens (no repetition penalty, no grammar) drawn by the
    engine's own sampler. Others decode plainly, with the same output."""
    sampling = seq.sampling
    return (seq.uses_arena and not seq.kv_policy.evicts and seq.sampler is None and sampling.grammar is None
            and sampling.repetition_penalty in (None, 1.0))


__all__ = ["make_sequence", "resolve_sampling", "speculates"]

"""Turn a validated API request into an `EngineJob`, or an `APIError` naming the offending field.

Everything that can be refused is refused here, before the engine sees the request: unknown model (404),
unsupported fields (among them `kv_dtype` / `kv_group_size`: the arena's storage is fixed at start-up), bad
sampling values, a KV policy `parse_policy` rejects, and a prompt + max_tokens the
arena can never hold (400 at once rather than a rejection after queueing).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

from cortexstream.errors import CortexStreamError, InvalidArgumentError
from cortexstream.engine.prompt import prompt_to_tokens
from cortexstream.engine.sampling import SamplingParams
from cortexstream.grammar.spec import GrammarSpec
from cortexstream.server.agent_prepare import PreparedTurn, ToolSupport, prepare_turn
from cortexstream.server.chat_spec import ChatSpec
from cortexstream.server.chat_translate import chat_to_spec
from cortexstream.server.jobs import EngineJob
from cortexstream.server.errors import APIError
from cortexstream.server.protocol import MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest
from cortexstream.server.wire import refuse_unknown_fields


@dataclass(frozen=True)
class ArenaLimits:
    num_blocks: int
    block_size: int

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass
class PreparedRequest:
    job: EngineJob
    response_id: str
    prompt_tokens: int
    tool_names: tuple[str, ...] = ()  # the tools offered when each completion's text is read for calls

    @property
    def parse_tools(self) -> bool:
        """Whether each completion's text is read for tool calls (see agent_prepare.py)."""
        return bool(self.tool_names)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested not in (served, "default", "default_model"):
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


# Accepted by the protocol as unknown fields, but never ignored: one arena has one storage type, so a request that
# asks for one must learn it did not get it.
STARTUP_ONLY_FIELDS = {"kv_dtype": "--kv-dtype", "kv_group_size": "--kv-group-size"}


def refuse_startup_only_fields(request: Any) -> None:
    """400 for a body that carries a field only the server's start-up options decide (see STARTUP_ONLY_FIELDS)."""
    extra = request.model_extra or {}
    for name, flag in STARTUP_ONLY_FIELDS.items():
        if name in extra:
            raise APIError(400, f"{name}: the server's KV storage is fixed at startup ({flag}; GET /v1/kv shows "
                                "it): one arena has one storage type, so a request cannot choose it; leave the "
                                "field out",
                           param=name, code="unsupported_parameter")


def _param_of(exc: Exception) -> str | None:
    head = str(exc).split(":", 1)[0].strip()
    return head if head.isidentifier() else None


def _sampling(request: Any, max_tokens: int, grammar: GrammarSpec | None = None) -> SamplingParams:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name, None):
            raise APIError(400, f"{name}: not supported by this server (use repetition_penalty)", param=name,
                           code="unsupported_parameter")
    stops = request.stop_strings() if hasattr(request, "stop_strings") else tuple(request.stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else float(request.temperature),
            top_p=1.0 if request.top_p is None else float(request.top_p),
            top_k=request.top_k or 0,
            min_p=getattr(request, "min_p", None) or 0.0,
            repetition_penalty=getattr(request, "repetition_penalty", None),
            max_tokens=max_tokens,
            stop=stops,
            seed=request.seed,
            grammar=grammar,
        )
    except InvalidArgumentError as exc:
        raise APIError(400, str(exc), param=_param_of(exc)) from exc


def _policy(spec: str | None, default: Any) -> Any:
    from cortexstream.policies import parse_policy

    if spec is None:
        return parse_policy(default)  # the server's default policy, or FullCache()
    try:
        return parse_policy(spec)
    except (CortexStreamError, ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"kv_policy: {exc}", param="kv_policy") from exc


def check_policy(spec: str | None, prepared: "PreparedRequest", problem_of: Callable[[Any], str | None]) -> None:
    """A request's own `kv_policy` that this engine cannot run (`problem_of(policy)` says why, e.g. a score-based
    policy on distributed ranks): a 400 naming the field, for that request alone."""
    if spec is None:
        return
    problem = problem_of(prepared.job.kv_policy)
    if problem is not None:
        raise APIError(400, f"kv_policy: {problem}", param="kv_policy", code="unsupported_kv_policy")


def _fit(prompt_len: int, requested: int | None, default: int, n: int, policy: Any, arena: ArenaLimits) -> int:
    """max_tokens for the request: the requested value if it fits, the default shrunk to fit otherwise."""
    def blocks(max_tokens: int) -> int:
        if policy.evicts:
            return n * arena.blocks_for(policy.peak_tokens(prompt_len + max_tokens, 512, prompt_len))
        # n completions share the prompt's blocks; each has its own for its tokens (+1 copied on write).
        extra = 0 if n == 1 else n * (arena.blocks_for(max_tokens) + 1)
        return arena.blocks_for(prompt_len + (max_tokens if n == 1 else 0)) + extra

    capacity = arena.num_blocks * arena.block_size
    if requested is None:
        max_tokens = default
        while max_tokens > 1 and blocks(max_tokens) > arena.num_blocks:
            max_tokens //= 2
        requested = max_tokens
    if blocks(requested) > arena.num_blocks:
        raise APIError(
            400,
            f"This request needs {prompt_len} prompt tokens + {requested} max_tokens x {n} completions, more "
            f"than the KV arena's {capacity} tokens; shorten the prompt or lower max_tokens",
            param="max_tokens", code="context_length_exceeded",
        )
    return requested


def _speculative(spec: str | None) -> str | None:
    """The request's `speculative` field checked now (a bad one is a 400 naming it); None: the server's default."""
    from cortexstream.engine.speculative_config import parse_speculative

    try:
        parse_speculative(spec)
    except CortexStreamError as exc:
        raise APIError(400, str(exc), param="speculative") from exc
    return spec


def _job(prefix: str, tokens: list[int], sampling: SamplingParams, n: int, policy: Any, tenant: str | None,
         top_logprobs: int | None, speculative: str | None = None) -> PreparedRequest:
    base = f"{prefix}-{uuid.uuid4().hex}"
    ids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
    fork = not policy.evicts
    job = EngineJob(ids, tokens, sampling, kv_policy=policy, tenant=tenant, top_logprobs=top_logprobs, fork=fork,
                    speculative=_speculative(speculative))
    return PreparedRequest(job, base, len(tokens))


def prepare_chat(request: ChatCompletionRequest, tokenizer: Any, arena: ArenaLimits, default_policy: Any,
                 tenant: str | None, default_max_tokens: int, tools: ToolSupport) -> PreparedRequest:
    refuse_startup_only_fields(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    turn = prepare_turn(chat_to_spec(request), tokenizer, tools)
    policy = _policy(request.kv_policy, default_policy)
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    max_tokens = _fit(len(turn.tokens), requested, default_max_tokens, request.n, policy, arena)
    sampling = _sampling(request, max_tokens, turn.grammar)
    top = (request.top_logprobs or 0) if request.logprobs else None
    prepared = _job("chatcmpl", turn.tokens, sampling, request.n, policy, tenant, top, request.speculative)
    prepared.tool_names = turn.tool_names
    return prepared


def prepare_spec(spec: ChatSpec, prefix: str, tokenizer: Any, arena: ArenaLimits, default_policy: Any,
                 tenant: str | None, default_max_tokens: int, tools: ToolSupport) -> tuple[PreparedRequest,
                                                                                         PreparedTurn]:
    """One completion of a ChatSpec (/v1/messages, /v1/responses) on the server's default KV policy."""
    turn = prepare_turn(spec, tokenizer, tools)
    policy = _policy(None, default_policy)
    max_tokens = _fit(len(turn.tokens), spec.max_tokens, default_max_tokens, 1, policy, arena)
    prepared = _job(prefix, turn.tokens, _sampling(spec, max_tokens, turn.grammar), 1, policy, tenant, None)
    prepared.tool_names = turn.tool_names
    return prepared, turn


def prepare_completion(request: CompletionRequest, tokenizer: Any, arena: ArenaLimits, default_policy: Any,
                       tenant: str | None, default_max_tokens: int) -> PreparedRequest:
    refuse_startup_only_fields(request)
    refuse_unknown_fields(request)
    if request.echo:
        raise APIError(400, "echo: not supported by this server", param="echo", code="unsupported_parameter")
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (a list of strings must hold exactly one)",
                           param="prompt")
        prompt = prompt[0]
    try:
        tokens = prompt_to_tokens(tokenizer, prompt)
    except InvalidArgumentError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    policy = _policy(request.kv_policy, default_policy)
    max_tokens = _fit(len(tokens), request.max_tokens, default_max_tokens, request.n, policy, arena)
    sampling = _sampling(request, max_tokens)
    return _job("cmpl", tokens, sampling, request.n, policy, tenant, request.logprobs, request.speculative)

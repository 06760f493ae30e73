"""`create_app(model, tokenizer, config)`: the FastAPI app with its engine, started and stopped by the lifespan."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI

from cortexstream.engine.memory_budget import (
    DraftCost, MemoryBudget, MemoryPlan, plan_memory, resident_bytes, weights_bytes)
from cortexstream.server.agent_prepare import ToolSupport
from cortexstream.server.agent_routes import agent_router
from cortexstream.server.anthropic_events import anthropic_error_body
from cortexstream.server.auth import AuthMiddleware, KeyRing
from cortexstream.server.bridge import EventLoopBridge
from cortexstream.server.config import ServerConfig
from cortexstream.server.errors import install_error_handlers
from cortexstream.server.limits import SizeLimitMiddleware
from cortexstream.server.metrics import Metrics
from cortexstream.server.prepare import ArenaLimits
from cortexstream.server.response_store import ResponseStore
from cortexstream.server.routes import router, token_text_for


@dataclass
class ServerState:
    """What the handlers share (app.state.server)."""

    config: ServerConfig
    model_name: str
    tokenizer: Any
    bridge: EventLoopBridge
    keys: KeyRing
    metrics: Metrics
    arena_limits: ArenaLimits
    default_policy: Any
    token_text: Any
    started: int
    tools: ToolSupport
    response_store: ResponseStore
    memory_plan: MemoryPlan | None = None  # how --max-memory was split (None: no budget given)
    draining: bool = False


# The engine's default, given to the engine and to the memory plan alike, so that the plan sizes the step the
# scheduler really runs.
PREFILL_STEP_SIZE = 512


def memory_plan(model: Any, config: ServerConfig) -> MemoryPlan | None:
    """How `config.max_memory` is split for `model` (None when no budget is given). Measured now: call it with
    the model loaded and before the engine is built."""
    if config.max_memory is None:
        return None
    from cortexstream.kv.disk import DiskTierConfig, parse_size

    # What the disk tier holds in memory (reserved even if the directory turns out unusable: that is not known
    # until the engine opens it).
    queue = 0
    if config.kv_disk is not None:  # its writer queue, and the blocks a restore and an export hold at once
        from cortexstream.engine.disk_tier import working_bytes
        from cortexstream.kv.arena_config import ArenaConfig

        per_block = ArenaConfig.for_model(model, num_tokens=config.block_size, block_size=config.block_size,
                                          kv_dtype=config.kv_dtype, kv_group_size=config.kv_group_size).bytes_per_block
        queue = (DiskTierConfig(config.kv_disk, parse_size(config.kv_disk_size, "kv_disk_size")).writer_queue_bytes
                 + working_bytes(per_block, config.block_size, PREFILL_STEP_SIZE))
    what = "max_memory (--max-memory)"
    budget = MemoryBudget.parse(config.max_memory, what)
    baseline = max(0, resident_bytes() - weights_bytes(model))  # before a draft model raises the peak
    return plan_memory(model, budget, block_size=config.block_size,
                       max_num_seqs=config.max_num_seqs, prefill_step_size=PREFILL_STEP_SIZE,
                       kv_dtype=config.kv_dtype, kv_group_size=config.kv_group_size, disk_queue_bytes=queue,
                       baseline_bytes=baseline, what=what, draft=draft_cost(config.speculative, config.block_size))


def draft_cost(speculative: Any, block_size: int) -> DraftCost | None:
    """A draft model's share of the memory plan when the server's default speculation names one, else None."""
    from cortexstream.engine.speculative_config import SpeculativeMethod, parse_speculative

    spec = parse_speculative(speculative)
    if spec is None or spec.method is not SpeculativeMethod.DRAFT:
        return None
    return DraftCost.measure(str(spec.model), block_size)


def build_engine(model: Any, tokenizer: Any, config: ServerConfig, plan: MemoryPlan | None = None) -> Any:
    """The server's engine. With `config.max_memory`, its arena is the plan's (`plan`, else planned now) and MLX's
    allocations and buffer cache are bounded by it."""
    from cortexstream.engine.engine import Engine
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import ArenaConfig

    storage = {"block_size": config.block_size, "kv_dtype": config.kv_dtype, "kv_group_size": config.kv_group_size}
    if plan is None:
        plan = memory_plan(model, config)
    if plan is not None:
        arena = KVArena(plan.arena)
    elif config.kv_memory is not None:
        arena = KVArena(ArenaConfig.for_model(model, memory_fraction=config.kv_memory, **storage))
    else:
        arena = KVArena(ArenaConfig.for_model(model, num_tokens=config.kv_tokens or 16384, **storage))
    # An unusable --kv-disk directory (or one another process owns) does not stop the server: it serves the
    # prefix cache from RAM and says why in its log and in /metrics (`Engine.disk_problem`).
    engine = Engine(model, tokenizer, arena=arena, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                    prefill_step_size=PREFILL_STEP_SIZE, kv_policy=config.kv_policy, kv_disk=config.kv_disk,
                    kv_disk_size=config.kv_disk_size, kv_disk_required=False, speculative=config.speculative)
    if plan is not None:  # after the engine: building its backend raises the buffer cache for speed
        engine.backend.limit_memory(plan.mlx_bytes, plan.cache_bytes)
    return engine


def create_app(model: Any, tokenizer: Any, config: ServerConfig | None = None, engine: Any = None) -> FastAPI:
    """The ASGI app. The engine thread starts with the app's lifespan and stops with it."""
    config = config or ServerConfig()
    if engine is not None and config.max_memory is not None:
        raise ValueError("max_memory: sizes the engine create_app builds; an engine passed in is already sized")
    plan = memory_plan(model, config) if engine is None else None
    engine = engine if engine is not None else build_engine(model, tokenizer, config, plan)
    metrics = Metrics(config.model_name, getattr(engine, "disk_problem", None), plan)  # a test's engine may have none
    view = engine.snapshot(blocks=False)  # the engine thread has not started: read it here
    bridge = EventLoopBridge(engine, handoff=config.handoff, on_events=metrics.on_event)
    from cortexstream.policies import parse_policy

    state = ServerState(
        config=config, model_name=config.model_name, tokenizer=tokenizer, bridge=bridge,
        keys=KeyRing(config.api_keys), metrics=metrics,
        arena_limits=ArenaLimits(view.num_blocks, view.block_size),
        default_policy=parse_policy(config.kv_policy) if config.kv_policy else None,
        token_text=token_text_for(tokenizer), started=int(time.time()),
        tools=ToolSupport.for_tokenizer(tokenizer), response_store=ResponseStore(), memory_plan=plan,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        bridge.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.draining = True
            bridge.stop()

    app = FastAPI(title="CortexStream", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API on the CortexStream engine")
    app.state.server = state
    app.state.error_bodies = {"/v1/messages": anthropic_error_body}  # Anthropic's clients read their own shape
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(agent_router)
    app.add_middleware(AuthMiddleware, keys=state.keys)
    # Added last, so it runs first: oversized requests are refused before anything reads them.
    app.add_middleware(SizeLimitMiddleware, max_body_bytes=config.max_body_bytes,
                       max_header_bytes=config.max_header_bytes)
    return app

"""`GET /v1/kv`: the arena's stats and block map as JSON, taken on the engine thread (one consistent snapshot).

`block_map[i]` is block i's state: "free", "shared" (more than one reference: a prefix reused by several
sequences, or a block the prefix cache also holds) or "used"; `block_tenants[i]` is the tenant label of the
sequence that allocated it (null when free). `sequences` lists the live ones with their block tables, so a
client can see which blocks two requests have in common.
"""

from __future__ import annotations

from typing import Any

from cortexstream.engine.engine import Engine


def kv_snapshot(engine: Engine, owner_tenants: dict[int, str | None], tenant_auth: bool,
                viewer: str | None = None) -> dict[str, Any]:
    """With API keys, `sequences` lists only the viewer's own (other tenants' requests stay private); the block
    map, which shows which tenant holds each block but nothing of their content, covers the whole arena."""
    allocator = engine.arena.allocator
    ref_counts = [allocator.ref_count(b) for b in range(allocator.num_total_blocks)]
    exact_owners = [allocator.owner_of(b) for b in range(allocator.num_total_blocks)]
    states, tenants = [], []
    for block, refs in enumerate(ref_counts):
        if refs == 0:
            states.append("free")
            tenants.append(None)
            continue
        states.append("shared" if refs > 1 else "used")
        tenant = owner_tenants.get(exact_owners[block])
        tenants.append(_label(tenant, tenant_auth))
    cached = set(engine.block_manager._lru) if hasattr(engine.block_manager, "_lru") else set()
    sequences = [
        {
            "id": seq.request_id,
            "tenant": _label(seq.tenant, tenant_auth),
            "status": seq.status.value,
            "blocks": list(seq.block_table),
            "num_tokens": seq.num_tokens,
            "num_computed": seq.num_computed,
            "cached_prefix_tokens": seq.num_cached_prefix,
        }
        for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting)
        if not tenant_auth or seq.tenant == viewer
    ]
    stats = {k: v for k, v in engine.stats().items() if isinstance(v, (int, float, str))}
    return {
        "arena": stats,
        "block_size": engine.arena.config.block_size,
        "num_blocks": allocator.num_total_blocks,
        "num_free_blocks": allocator.num_free_blocks,
        "num_used_blocks": allocator.num_used_blocks,
        "num_prefix_cached_blocks": len(cached),
        # Used blocks that no live sequence holds and the prefix cache does not hold either: must stay 0.
        "num_orphan_blocks": _orphans(ref_counts, _all_tables(engine), cached),
        "block_map": states,
        "block_ref_counts": ref_counts,
        "block_tenants": tenants,
        "prefix_cached_blocks": sorted(cached),
        "sequences": sequences,
    }


def _label(tenant: str | None, tenant_auth: bool) -> str | None:
    if tenant is None:
        return None if tenant_auth else "default"
    return tenant


def _all_tables(engine: Engine) -> list[list[int]]:
    return [list(seq.block_table) for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting)]


def _orphans(ref_counts: list[int], tables: list[list[int]], cached: set[int]) -> int:
    expected = [0] * len(ref_counts)
    for table in tables:
        for block in table:
            expected[block] += 1
    for block in cached:
        expected[block] += 1
    return sum(1 for have, want in zip(ref_counts, expected) if have != want)

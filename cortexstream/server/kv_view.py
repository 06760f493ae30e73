"""`GET /v1/kv`: the arena's stats and block map as JSON, from one `EngineView` (taken between two engine steps).

`kv_dtype` is how the arena stores K and V ("float32", "int8", "k=int8,v=int4", ...), fixed at start-up;
`bytes_per_token` what one token's K and V take over all layers, and `token_capacity` the tokens the arena holds.
`block_map[i]` is block i's state: "free", "shared" (more than one reference: a prefix reused by several
sequences, or a block the prefix cache also holds) or "used"; `block_tenants[i]` is the tenant label of the
sequence that allocated it (null when free). `sequences` lists the live ones with their block tables, so a
client can see which blocks two requests have in common.
"""

from __future__ import annotations

from typing import Any

from cortexstream.engine.snapshot import EngineView


def kv_snapshot(view: EngineView, owner_tenants: dict[int, str | None], tenant_auth: bool,
                viewer: str | None = None) -> dict[str, Any]:
    """`view`: an `EngineClient.snapshot()` taken with blocks. With API keys, `sequences` lists only the viewer's
    own (other tenants' requests stay private); the block map, which shows which tenant holds each block but
    nothing of their content, covers the whole arena."""
    ref_counts = view.block_ref_counts.tolist()
    exact_owners = view.block_owners.tolist()
    states, tenants = [], []
    for block, refs in enumerate(ref_counts):
        if refs == 0:
            states.append("free")
            tenants.append(None)
            continue
        states.append("shared" if refs > 1 else "used")
        tenant = owner_tenants.get(exact_owners[block])
        tenants.append(_label(tenant, tenant_auth))
    cached = set(view.prefix_cached_blocks)
    sequences = [
        {
            "id": seq.request_id,
            "tenant": _label(seq.tenant, tenant_auth),
            "status": seq.status,
            "blocks": list(seq.block_table),
            "num_tokens": seq.num_tokens,
            "num_computed": seq.num_computed,
            "cached_prefix_tokens": seq.num_cached_prefix,
        }
        for seq in view.sequences
        if not tenant_auth or seq.tenant == viewer
    ]
    stats = {k: v for k, v in view.stats.items() if isinstance(v, (int, float, str))}
    return {
        "arena": stats,
        "kv_dtype": view.stats["kv_dtype"],
        "bytes_per_token": view.stats["bytes_per_token"],
        "token_capacity": view.num_blocks * view.block_size,
        "block_size": view.block_size,
        "num_blocks": view.num_blocks,
        "num_free_blocks": view.num_free_blocks,
        "num_used_blocks": view.num_used_blocks,
        "num_prefix_cached_blocks": len(cached),
        # Used blocks that no live sequence holds and the prefix cache does not hold either: must stay 0.
        "num_orphan_blocks": _orphans(ref_counts, [list(seq.block_table) for seq in view.sequences], cached),
        "block_map": states,
        "block_ref_counts": ref_counts,
        "block_tenants": tenants,
        "prefix_cached_blocks": sorted(cached),
        # The disk tier's counters (engine/disk_tier.py) without their `disk_` prefix; null without a tier.
        "disk": {k[len("disk_"):]: v for k, v in view.stats.items() if k.startswith("disk_")} or None,
        "sequences": sequences,
    }


def _label(tenant: str | None, tenant_auth: bool) -> str | None:
    if tenant is None:
        return None if tenant_auth else "default"
    return tenant


def _orphans(ref_counts: list[int], tables: list[list[int]], cached: set[int]) -> int:
    expected = [0] * len(ref_counts)
    for table in tables:
        for block in table:
            expected[block] += 1
    for block in cached:
        expected[block] += 1
    return sum(1 for have, want in zip(ref_counts, expected) if have != want)

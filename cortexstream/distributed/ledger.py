"""`BlockLedger`: what a rank's runner was told about KV blocks, folded into a digest the ranks can compare.

Only rank 0 allocates blocks (its scheduler's block manager); the other ranks write wherever the plans' block
tables say. So the ranks' KV layouts agree exactly when every rank executed the same block operations in the
same order. Each rank applies every plan it executes (rank 0 before encoding it, the others after decoding it):
the live block table of each request (its last work item's, reconstruction chunks included), the requests dropped,
the copy-on-write pairs and the number of blocks in use. `digest()` hashes the running history and the live
tables; rank 0 compares the other ranks' digests with its own at shutdown (DistributedSession.close).
"""

from __future__ import annotations

import hashlib
import json

from cortexstream.engine.step_plan import StepPlan


class BlockLedger:
    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, ...]] = {}  # "engine/request" -> its block table as last executed
        self.steps = 0
        self.copies = 0
        self.score_items = 0  # reconstruction chunks (`StepPlan.score`) executed
        self._history = hashlib.sha256()

    def apply(self, plan: StepPlan, engine_id: int) -> None:
        """Fold one executed plan of engine `engine_id` in."""
        self.steps += 1
        for request_id in plan.dropped:
            self.tables.pop(f"{engine_id}/{request_id}", None)
        self.copies += len(plan.copies)
        self.score_items += len(plan.score)
        record = {"engine": engine_id, "new": [[spec.request_id, spec.owner] for spec in plan.new_requests], "dropped": list(plan.dropped),
                  "copies": [list(pair) for pair in plan.copies], "used": plan.num_blocks_used, "items": []}
        for item in (*plan.prefill, *plan.decode, *plan.score):
            self.tables[f"{engine_id}/{item.request_id}"] = item.block_table
            record["items"].append([item.request_id, item.kind.value, item.start, item.physical_start,
                                    list(item.block_table)])
        self._history.update(json.dumps(record, separators=(",", ":")).encode())

    def digest(self) -> str:
        """The history of block operations and the live block tables, as one hex string."""
        live = json.dumps(sorted((rid, list(table)) for rid, table in self.tables.items()), separators=(",", ":"))
        return hashlib.sha256(self._history.hexdigest().encode() + live.encode()).hexdigest()

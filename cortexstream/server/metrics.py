"""Prometheus text-format metrics (names after vLLM's, prefixed `cortexstream:`).

Counters and histograms are updated on the event loop as token events are delivered; gauges come from an
`EngineView` taken when scraped (`EngineClient.snapshot(blocks=False)`, between two engine steps). Should the
engine thread be gone, the last view taken is shown again (no gauges before a first one).
"""

from __future__ import annotations

import bisect

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.memory_budget import MemoryPlan
from cortexstream.engine.snapshot import EngineView
from cortexstream.server.jobs import RequestHandle, TokenEvent

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help = help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, model: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets + (float("inf"),), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{model_name="{model}",le="{le}"}} {cumulative}')
        lines.append(f'{self.name}_sum{{model_name="{model}"}} {self.total}')
        lines.append(f'{self.name}_count{{model_name="{model}"}} {self.count}')
        return lines


def _storage_info(labels: str, view: EngineView) -> list[str]:
    """Info-style gauge (value 1, the labels carry the facts, as vLLM's cache_config_info): the arena's KV dtype,
    fixed at start-up."""
    name = "cortexstream:kv_cache_config_info"
    kv_dtype = view.stats["kv_dtype"]  # canonical text ("int8", "k=int8,v=int4"): nothing to escape
    return [f"# HELP {name} How the KV arena stores K and V (labels kv_dtype, block_size).",
            f"# TYPE {name} gauge",
            f'{name}{{{labels},kv_dtype="{kv_dtype}",block_size="{view.block_size}"}} 1']


# Disk tier counters shown in /metrics: the engine stats key (engine/disk_tier.py) -> (metric kind, help).
_DISK_METRICS = {
    "disk_blocks": ("gauge", "KV blocks of this model in the disk tier."),
    "disk_bytes_on_disk": ("gauge", "Bytes of the disk tier's segment files (every model sharing the directory)."),
    "disk_hit_blocks": ("counter", "Prefix blocks found on disk at admission."),
    "disk_restored_blocks": ("counter", "Prefix blocks read back from disk instead of recomputed."),
    "disk_restored_tokens": ("counter", "Prompt tokens read back from disk instead of recomputed."),
    "disk_failed_blocks": ("counter", "Prefix blocks found on disk but recomputed (evicted or damaged meanwhile)."),
    "disk_restore_seconds": ("counter", "Seconds from admission to restored payloads, summed over restores."),
    "disk_puts": ("counter", "KV blocks written to disk."),
    "disk_dropped_puts": ("counter", "KV blocks not written (queue full or writing off)."),
    "disk_corrupt_skipped": ("counter", "Damaged records found on disk and skipped."),
    "disk_evicted_blocks": ("counter", "KV blocks deleted from disk by LRU eviction."),
}


# Speculative decoding counters shown in /metrics: the engine stats key (engine/scheduler.py) -> help.
_SPECULATIVE_METRICS = {
    "spec_verify_steps": "Verify passes that checked drafted tokens (speculative decoding).",
    "spec_drafted_tokens": "Tokens drafted (prompt lookup or a draft model).",
    "spec_accepted_tokens": "Drafted tokens the target model accepted.",
}


def _disk_lines(labels: str, view: EngineView | None, problem: str | None) -> list[str]:
    """The disk tier: whether it is on (with the reason when a directory was given but cannot be used, or
    writing stopped), and its counters."""
    stats = view.stats if view is not None else {}
    name = "cortexstream:kv_disk_enabled"
    reason = problem or stats.get("disk_write_disabled_reason")
    on = 1 if "disk_blocks" in stats and problem is None else 0
    lines = [f"# HELP {name} 1 when the KV disk tier is on (reason: why it is off, or why writing stopped).",
             f"# TYPE {name} gauge"]
    escaped = "" if reason is None else str(reason).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    lines.append(f'{name}{{{labels},reason="{escaped}"}} {on}' if reason else f"{name}{{{labels}}} {on}")
    for key, (kind, help_text) in _DISK_METRICS.items():
        if key in stats:
            metric = f"cortexstream:kv_{key}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric}{{{labels}}} {stats[key]}"]
    return lines


def _memory_lines(labels: str, plan: MemoryPlan) -> list[str]:
    """The --max-memory budget and how it was split at start-up (engine/memory_budget.py)."""
    budget, parts = "cortexstream:memory_budget_bytes", "cortexstream:memory_plan_bytes"
    lines = [f"# HELP {budget} The process's memory budget (--max-memory).", f"# TYPE {budget} gauge",
             f"{budget}{{{labels}}} {plan.budget.total_bytes}",
             f"# HELP {parts} The budget's split at start-up (part: weights, baseline, activations, disk_queue, "
             "arena, slack); the parts add up to the budget.", f"# TYPE {parts} gauge"]
    lines += [f'{parts}{{{labels},part="{part}"}} {value}' for part, value in plan.parts().items()]
    return lines


class Metrics:
    def __init__(self, model_name: str, disk_problem: str | None = None, memory_plan: MemoryPlan | None = None) -> None:
        self.model = model_name
        self.disk_problem = disk_problem  # why a --kv-disk directory could not be used (None: fine or not asked)
        self.memory_plan = memory_plan  # how --max-memory was split (None: no budget given)
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.finished: dict[FinishReason, int] = {}
        self.ttft = Histogram("cortexstream:time_to_first_token_seconds",
                              "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.itl = Histogram("cortexstream:inter_token_latency_seconds",
                             "Time between consecutive tokens of one completion.", ITL_BUCKETS)
        self.e2e = Histogram("cortexstream:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", TTFT_BUCKETS)
        self._last_view: EngineView | None = None

    def on_accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens

    def on_event(self, handle: RequestHandle, event: TokenEvent) -> None:
        index = event.index
        if event.cached_tokens is not None and index == 0:
            self.prefix_hit_tokens += event.cached_tokens
        if event.token is not None:
            self.generation_tokens += 1
            last = handle.last_time[index]
            if last is None:
                self.ttft.observe(event.time - handle.arrival)
            else:
                self.itl.observe(event.time - last)
            handle.last_time[index] = event.time
        if event.finish_reason is not None:
            self.finished[event.finish_reason] = self.finished.get(event.finish_reason, 0) + 1
            self.e2e.observe(event.time - handle.arrival)

    def render(self, view: EngineView | None) -> str:
        """`view`: the engine now, or None when it cannot be had (the last one is used, if any)."""
        view = self._last_view = view if view is not None else self._last_view
        m = f'model_name="{self.model}"'

        def single(name: str, kind: str, help_text: str, value: float) -> list[str]:
            return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{m}}} {value}"]

        lines: list[str] = []
        if view is not None:
            lines += single("cortexstream:num_requests_running", "gauge", "Sequences in the running batch.",
                            len(view.running))
            lines += single("cortexstream:num_requests_waiting", "gauge", "Sequences waiting for admission.",
                            len(view.waiting))
            lines += single("cortexstream:kv_blocks_used", "gauge", "KV arena blocks in use (incl. prefix cache).",
                            view.num_used_blocks)
            lines += single("cortexstream:kv_blocks_total", "gauge", "KV arena blocks.", view.num_blocks)
            lines += single("cortexstream:kv_cache_usage_perc", "gauge", "Fraction of KV arena blocks in use.",
                            view.num_used_blocks / max(1, view.num_blocks))
            lines += single("cortexstream:kv_bytes_per_token", "gauge",
                            "KV arena bytes one token takes (K and V, all layers).", view.stats["bytes_per_token"])
            lines += _storage_info(m, view)
        if self.disk_problem is not None or (view is not None and "disk_blocks" in view.stats):
            lines += _disk_lines(m, view, self.disk_problem)
        if self.memory_plan is not None:
            lines += _memory_lines(m, self.memory_plan)
        lines += single("cortexstream:prefix_cache_hit_tokens_total", "counter",
                        "Prompt tokens served from the prefix cache.", self.prefix_hit_tokens)
        lines += single("cortexstream:prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                        self.prompt_tokens)
        lines += single("cortexstream:generation_tokens_total", "counter", "Generated tokens.",
                        self.generation_tokens)
        if view is not None:
            lines += single("cortexstream:num_preemptions_total", "counter", "Sequences preempted for KV blocks.",
                            view.num_preemptions)
            for key, help_text in _SPECULATIVE_METRICS.items():
                if key in view.stats:
                    lines += single(f"cortexstream:{key}_total", "counter", help_text, view.stats[key])
        name = "cortexstream:request_success_total"
        lines += [f"# HELP {name} Finished completions by finish reason.", f"# TYPE {name} counter"]
        for reason, count in sorted(self.finished.items()):
            lines.append(f'{name}{{{m},finished_reason="{reason}"}} {count}')
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(self.model)
        return "\n".join(lines) + "\n"

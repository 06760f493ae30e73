"""The memory-bound mode of `cortexstream bench serve` (`--workloads memory_bound`): one fixed KV byte budget and
as many long conversations at once as fit in it.

CortexStream runs once per `--kv-dtypes` entry, its arena sized to the same `--kv-budget-mib` bytes: the tokens that
storage type fits in the budget (`ArenaConfig.for_model(..., num_bytes=...)`) go to `cortexstream serve
--kv-tokens`, and /v1/kv is read back to check the arena the server built. `--max-num-seqs` is the number of
sessions, so the budget alone limits how many run. While the workload runs, /metrics is sampled every
`--sample-interval` seconds for the running and waiting gauges (a server without such gauges gets none); every
server also gets the client's count of requests streaming at once. mlx_lm.server (no KV quantization) and the
peers given with --peer-python (their KV quantization on) have no KV byte budget: their figures are as measured,
at whatever process memory they reached.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cortexstream.benchmarks.serve_client import RequestRecord, WorkloadRun, drive
from cortexstream.benchmarks.serve_memory_options import MemoryBoundOptions, is_quantized
from cortexstream.benchmarks.serve_memory_report import memory_ratios
from cortexstream.benchmarks.serve_processes import Launch, Peer, start_server
from cortexstream.benchmarks.serve_report import summarize
from cortexstream.benchmarks.serve_workloads import WorkloadSpec, memory_bound_workload

BLOCK_SIZE = 16  # cortexstream serve's default --block-size, which the benchmark leaves as it is
_RUNNING = ("num_requests_running", "scheduler_running_requests")  # cortexstream / vLLM-style, vllm-mlx
_WAITING = ("num_requests_waiting", "scheduler_waiting_requests")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def budget_tokens(model_dir: Path, kv_dtype: str, group_size: int | None, budget_bytes: int) -> tuple[int, int]:
    """(tokens, bytes per token) of the arena `kv_dtype` gets in `budget_bytes`, for the model in `model_dir`.

    The model is built from its config.json without weights (its parameters are never evaluated): the arena's
    shape needs only the layer count, KV heads, head dim and float type."""
    from cortexstream.kv.arena_config import ArenaConfig
    from cortexstream.models.loader import model_classes

    config = json.loads((model_dir / "config.json").read_text())
    model_class, args_class = model_classes(config)
    skeleton = model_class(args_class.from_dict(config))
    arena = ArenaConfig.for_model(skeleton, num_bytes=budget_bytes, block_size=BLOCK_SIZE, kv_dtype=kv_dtype,
                                  kv_group_size=group_size)
    return arena.num_slots, arena.bytes_per_token


def read_gauges(text: str) -> tuple[float | None, float | None]:
    """(running, waiting) from a Prometheus text page; None for a gauge the page does not have."""
    running = waiting = None
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if match.group(1).endswith(_RUNNING):
            running = (running or 0.0) + value
        elif match.group(1).endswith(_WAITING):
            waiting = (waiting or 0.0) + value
    return running, waiting


@dataclass(frozen=True)
class GaugeSample:
    at: float  # time.perf_counter()
    running: float
    waiting: float | None


async def sample_gauges(url: str, interval: float, stop: asyncio.Event) -> list[GaugeSample]:
    """Read /metrics every `interval` seconds until `stop` is set; nothing if the server has no running gauge."""
    import httpx

    samples: list[GaugeSample] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(max(5.0, 4 * interval))) as http:
        while not stop.is_set():
            try:
                response = await http.get(f"{url}/metrics")
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 200:
                running, waiting = read_gauges(response.text)
                if running is None:
                    return samples
                samples.append(GaugeSample(time.perf_counter(), running, waiting))
            elif response is not None and response.status_code in (404, 405):
                return samples
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
    return samples


async def drive_sampled(url: str, workload: WorkloadSpec, timeout: float, model: str,
                        interval: float) -> tuple[WorkloadRun, list[GaugeSample]]:
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_gauges(url, interval, stop))
    try:
        run = await drive(url, workload, timeout, model)
    finally:
        stop.set()
        samples = await sampler
    return run, samples


def streaming_concurrency(records: list[RequestRecord], started: float, finished: float) -> tuple[int, float]:
    """(peak, time-weighted mean) of the requests between their first and last token, as the client saw them."""
    events = []
    for record in records:
        if record.first_token is not None:
            events += [(record.first_token, 1), (record.last_token or record.first_token, -1)]
    events.sort()  # at one instant an end (-1) comes before a start (+1)
    level = peak = 0
    area, previous = 0.0, started
    for at, step in events:
        area += level * (at - previous)
        previous, level = at, level + step
        peak = max(peak, level)
    return peak, area / max(finished - started, 1e-9)


def summarize_memory(run: WorkloadRun, samples: list[GaugeSample], peak_rss: int) -> dict[str, Any]:
    out = summarize(run, peak_rss)
    running = [s.running for s in samples]
    waiting = [s.waiting for s in samples if s.waiting is not None]
    streaming_peak, streaming_mean = streaming_concurrency(run.records, run.started, run.finished)
    out.update(completed=out["requests"] - out["failed"], gauge_samples=len(samples),
               running_peak=max(running) if running else None,
               running_mean=sum(running) / len(running) if running else None,
               waiting_peak=max(waiting) if waiting else None,
               streaming_peak=streaming_peak, streaming_mean=streaming_mean)
    return out


def _arena(url: str, launch: Launch, budget_bytes: int, bytes_per_token: int) -> dict[str, Any]:
    """The arena the server built (/v1/kv), refused unless it is the one the budget asked for."""
    import httpx

    kv = httpx.get(f"{url}/v1/kv", timeout=30).json()
    capacity, per_token = int(kv["token_capacity"]), int(kv["bytes_per_token"])
    if per_token != bytes_per_token or capacity != launch.kv_tokens or capacity * per_token > budget_bytes:
        raise RuntimeError(f"{launch.label}: the server's arena ({capacity} tokens x {per_token} bytes) is not the "
                           f"{launch.kv_tokens} x {bytes_per_token} bytes computed for the budget")
    return {"kv_dtype": kv["kv_dtype"], "kv_tokens": capacity, "bytes_per_token": per_token,
            "kv_bytes": capacity * per_token}


def _storage(launch: Launch) -> str:
    """How the server stores KV, as the report shows it (CortexStream's is replaced by what /v1/kv says)."""
    if launch.system == "cortexstream":
        return launch.kv_dtype or "auto"
    if launch.system == "mlx_lm":
        return "model float type (no KV quantization)"
    flags = Peer(launch.system).kv_flags(launch.kv_bits)
    return " ".join(flags) if flags else "its default (no KV quantization flag)"


def conversation_tokens(tokenizer: Any, workload: WorkloadSpec) -> int:
    """The longest conversation's tokens at its last turn's end (system, user turns, every reply at its
    max_tokens; the chat template's own tokens are not counted)."""
    def length(text: str | None) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

    return max(length(s.system) + sum(length(t.user_text) + t.max_tokens for t in s.turns) for s in workload.sessions)


def launches(options: MemoryBoundOptions, model_dir: Path, systems: list[str],
             sessions: int) -> list[tuple[Launch, int | None]]:
    """Every server to run, with the bytes per token computed for the CortexStream ones. The batch limit is the
    number of sessions for cortexstream, mlx_lm.server (--decode-concurrency) and mlx-vlm, so there only memory
    limits how many conversations run at once; vllm-mlx and rapid-mlx keep their own defaults."""
    out: list[tuple[Launch, int | None]] = []
    if "cortexstream" in systems:
        for kv_dtype in options.kv_dtypes:
            group = options.kv_group_size if is_quantized(kv_dtype) else None
            tokens, per_token = budget_tokens(model_dir, kv_dtype, group, options.budget_bytes)
            out.append((Launch("cortexstream", tokens, sessions, kv_dtype=kv_dtype, kv_group_size=group), per_token))
    if "mlx_lm" in systems:
        out.append((Launch("mlx_lm", None, sessions), None))
    for peer, python in options.peers:
        out.append((Launch(peer.value, None, sessions, python=python, kv_bits=options.peer_kv_bits), None))
    return out


def run_memory_bound(options: MemoryBoundOptions, model_dir: Path, tokenizer: Any, work: Path, systems: list[str],
                     *, seed: int, quick: bool, timeout: float) -> dict[str, Any]:
    workload = memory_bound_workload(tokenizer, seed, quick, options.sessions, options.history_tokens)
    budget_bytes = options.budget_bytes
    longest = conversation_tokens(tokenizer, workload)
    section: dict[str, Any] = {
        "name": workload.name, "description": workload.description, "sessions": len(workload.sessions),
        "kv_budget_mib": options.kv_budget_mib, "kv_budget_bytes": budget_bytes,
        "kv_group_size": options.kv_group_size, "peer_kv_bits": options.peer_kv_bits if options.peers else None,
        "sample_interval_s": options.sample_interval, "longest_conversation_tokens": longest, "runs": [],
    }
    for launch, per_token in launches(options, model_dir, systems, len(workload.sessions)):
        if launch.system == "cortexstream" and longest > launch.kv_tokens:
            print(f"[bench serve] warning: {launch.label}: the longest conversation ({longest} tokens) exceeds the "
                  f"arena ({launch.kv_tokens} tokens); its last turns will be refused", flush=True)
        print(f"[bench serve] {workload.name}: {launch.label}", flush=True)
        entry: dict[str, Any] = {"label": launch.label, "system": launch.system, "kv_storage": _storage(launch),
                                 "kv_budget_enforced": launch.system == "cortexstream"}
        try:
            server = start_server(launch, str(model_dir), work)
        except RuntimeError as exc:
            if launch.system == "cortexstream":
                raise
            text = str(exc).replace(str(model_dir), "MODEL_DIR")  # no local paths in the report
            section["runs"].append({**entry, "error": text[-1000:]})
            print(f"[bench serve]   did not start: {text[:300]}", flush=True)
            continue
        try:
            if per_token is not None:
                entry.update(_arena(server.url, launch, budget_bytes, per_token))
                entry["label"] = f"cortexstream {entry['kv_dtype']}"
                entry["kv_storage"] = entry["kv_dtype"]
            measured, samples = asyncio.run(
                drive_sampled(server.url, workload, timeout, server.model, options.sample_interval))
            entry.update(summarize_memory(measured, samples, server.peak_rss))
        finally:
            server.stop()
        entry["kv_quantized"] = is_quantized(launch.kv_dtype or "auto") if per_token is not None else None
        section["runs"].append(entry)
        print(f"[bench serve]   running peak {entry['running_peak']}, {entry['output_tokens_per_s']:.1f} output "
              f"tok/s, peak RSS {entry['peak_rss_mib']:.0f} MiB, {entry['failed']} failed", flush=True)
    section["ratios"] = memory_ratios(section["runs"])
    return section

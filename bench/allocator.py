"""Micro-benchmark: indexed BlockAllocator vs naive linear-scan allocators on random alloc/free.

Run: ``python -m bench.allocator`` (about 30 s on 2 cores). Writes
bench/results/allocator.json and bench/results/allocator.md.

Workloads (same seed for every allocator): a pool of N blocks is driven to a target occupancy by
contiguous requests of random size, then a timed steady state where each step either allocates
(if below target, with probability 0.6) or frees a random live handle. A request that does not fit
counts as a failed allocation and is still timed (finding out costs the naive allocators a full
scan). ``steady``: 75 % target, 1..64 blocks per request. ``pressure``: 95 % target, 1..256 blocks,
the regime of a nearly full arena where the scheduler keeps probing for room.
Only the allocator calls are timed (perf_counter_ns around each call, ~0.1 us of overhead per op
that every allocator pays equally). Each (workload, allocator, N) is run REPEATS times with the
same seed, interleaved; the best run is reported.

Baselines, both first fit over a ``bytearray`` bitmap (1 = used):
* ``naive-find``: ``bitmap.find(bytes(n))``, the linear scan done in C;
* ``naive-loop``: the textbook per-block Python loop (fewer timed ops: it is ~1000x slower).
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import numpy as np

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.errors import OutOfBlocksError
from cortexstream.kv.allocator import BlockAllocator
from cortexstream.benchmarks.runner import run_as_script

SIZES = (4096, 16384, 65536)
WORKLOADS = {"steady": (0.75, 64), "pressure": (0.95, 256)}  # name: (target occupancy, max request)
P_ALLOC = 0.6
SEED = 1234
REPEATS = 3
PROBES = 200  # largest_free_run() calls timed on the final state


class NaiveFind:
    """First fit by ``bytearray.find`` over the bitmap: O(N) per allocation, in C."""

    def __init__(self, num_blocks: int) -> None:
        self.bitmap = bytearray(num_blocks)

    def allocate(self, n: int) -> list[int]:
        start = self.bitmap.find(bytes(n))
        if start < 0:
            raise OutOfBlocksError(f"no run of {n}")
        self.bitmap[start : start + n] = b"\x01" * n
        return list(range(start, start + n))

    def free(self, blocks: list[int]) -> int:
        self.bitmap[blocks[0] : blocks[-1] + 1] = bytes(len(blocks))
        return len(blocks)

    def largest_free_run(self) -> int:
        """What a scheduler probes before admitting a request: a vectorised O(N) scan here."""
        used = np.frombuffer(self.bitmap, dtype=np.int8)
        one = np.ones(1, dtype=np.int8)  # keep int8: int64 temporaries made this 5x slower
        edges = np.diff(np.concatenate((one, used, one)))
        starts, ends = np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)
        return int((ends - starts).max(initial=0))


class NaiveLoop(NaiveFind):
    """First fit by a per-block Python loop over the bitmap: O(N) interpreted steps."""

    def allocate(self, n: int) -> list[int]:
        run = 0
        for i, used in enumerate(self.bitmap):
            run = 0 if used else run + 1
            if run == n:
                start = i - n + 1
                self.bitmap[start : i + 1] = b"\x01" * n
                return list(range(start, i + 1))
        raise OutOfBlocksError(f"no run of {n}")


class Indexed:
    """Adapter so the harness calls every allocator the same way."""

    def __init__(self, num_blocks: int) -> None:
        self.a = BlockAllocator(num_blocks)

    def allocate(self, n: int) -> list[int]:
        return self.a.allocate(n, owner=1, contiguous=True)

    def free(self, blocks: list[int]) -> int:
        return self.a.free(blocks)

    def largest_free_run(self) -> int:
        return self.a.largest_free_run()


def run(impl: type, num_blocks: int, timed_steps: int, workload: str) -> dict:
    target, max_req = WORKLOADS[workload]
    rng = random.Random(SEED + num_blocks)
    alloc = impl(num_blocks)
    live: list[list[int]] = []
    used = 0
    # enough untimed steps to reach the occupancy target and churn through it once
    warmup = int(2 * num_blocks * target / ((max_req + 1) / 2) / P_ALLOC)
    t_alloc = t_free = n_alloc = n_free = n_fail = 0
    clock = time.perf_counter_ns
    for step in range(warmup + timed_steps):
        timed = step >= warmup
        if live and (used >= target * num_blocks or rng.random() >= P_ALLOC):
            blocks = live.pop(rng.randrange(len(live)))
            t0 = clock()
            alloc.free(blocks)
            dt = clock() - t0
            used -= len(blocks)
            if timed:
                t_free += dt
                n_free += 1
            continue
        n = rng.randint(1, max_req)
        t0 = clock()
        try:
            blocks = alloc.allocate(n)
        except OutOfBlocksError:
            blocks = None
        dt = clock() - t0
        if timed:
            t_alloc += dt
            n_alloc += 1
            n_fail += blocks is None
        if blocks is not None:
            live.append(blocks)
            used += n
    ops = n_alloc + n_free
    batches = []  # min over batches: a probe is short enough that a neighbour's burst dominates
    for _ in range(5):
        t0 = clock()
        for _ in range(PROBES // 5):
            largest = alloc.largest_free_run()
        batches.append((clock() - t0) / (PROBES // 5))
    t_probe = min(batches)
    out = {
        "workload": workload,
        "allocator": impl.__name__,
        "num_blocks": num_blocks,
        "timed_ops": ops,
        "us_per_op": (t_alloc + t_free) / ops / 1e3,
        "ops_per_s": ops / ((t_alloc + t_free) / 1e9),
        "us_per_alloc": t_alloc / max(n_alloc, 1) / 1e3,
        "us_per_free": t_free / max(n_free, 1) / 1e3,
        "failed_allocs": n_fail,
        "occupancy_end": used / num_blocks,
        "us_per_largest_free_run": t_probe / 1e3,
        "largest_free_run_end": largest,
    }
    if isinstance(alloc, Indexed):
        alloc.a.check_invariants()  # the fast numbers only count if the state is still right
        free = alloc.a.block_map() == -1  # maximal runs of free blocks, from the public block map
        out["free_runs_end"] = int(free[0]) + int(np.count_nonzero(free[1:] & ~free[:-1])) if len(free) else 0
        out["fragmentation_end"] = round(alloc.a.fragmentation(), 4)
    return out


def best_runs(plan: dict, num_blocks: int, workload: str) -> list[dict]:
    """Best of REPEATS per allocator, with the repeats interleaved across allocators so that a
    burst of load from a neighbour on this shared box hits all of them alike; the minimum is the
    usual estimator of a micro-benchmark's own cost under outside interference."""
    runs: dict[type, list[dict]] = {impl: [] for impl in plan}
    for rep in range(REPEATS):
        for impl, (timed_steps, repeats) in plan.items():
            if rep < repeats:
                runs[impl].append(run(impl, num_blocks, timed_steps, workload))
    out = []
    for impl_runs in runs.values():
        best = min(impl_runs, key=lambda r: r["us_per_op"])
        best["repeats"] = len(impl_runs)
        best["us_per_op_all"] = [round(r["us_per_op"], 3) for r in impl_runs]
        out.append(best)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    # naive-loop is ~100-1000x slower: fewer steps and one repeat keep the bench under a minute
    plan = {Indexed: (20000, REPEATS), NaiveFind: (20000, REPEATS), NaiveLoop: (300, 1)}
    results = []
    t_start = time.perf_counter()
    for workload in WORKLOADS:
        for num_blocks in SIZES:
            for r in best_runs(plan, num_blocks, workload):
                results.append(r)
                print(
                    f"{workload:>8} {r['allocator']:>9} N={num_blocks:>6}: {r['us_per_op']:8.2f} us/op "
                    f"({r['ops_per_s']:>9,.0f} ops/s)  alloc {r['us_per_alloc']:7.2f} us  "
                    f"free {r['us_per_free']:5.2f} us  failed {r['failed_allocs']}/{r['timed_ops']}",
                    flush=True,
                )
    elapsed = time.perf_counter() - t_start
    out_dir = str(args.out)
    meta = {
        "python": platform.python_version(),
        "machine": machine(),
        "workloads": {k: {"target_occupancy": t, "request_blocks": [1, m]} for k, (t, m) in WORKLOADS.items()},
        "p_alloc": P_ALLOC,
        "seed": SEED,
        "elapsed_s": round(elapsed, 1),
    }
    json_path, _ = write_results(out_dir, "allocator", {"meta": meta, "results": results}, to_markdown(meta, results))
    print(f"wrote {json_path} and allocator.md in {elapsed:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.allocator")


def to_markdown(meta: dict, results: list[dict]) -> str:
    by = {(r["workload"], r["allocator"], r["num_blocks"]): r for r in results}
    where = meta["machine"] if isinstance(meta["machine"], str) else machine_sentence(meta["machine"])  # older: str
    lines = [
        "# Block allocator micro-benchmark",
        "",
        f"`python -m bench.allocator` on Python {meta['python']}, {where}; "
        f"{meta['elapsed_s']} s in all. Contiguous allocate/free, mean time per allocator call "
        "(best of 3 interleaved runs for indexed and naive-find), lower is better. See the script's docstring "
        "for the workloads.",
        "",
        "| workload | blocks | indexed us/op | naive-find us/op | naive-loop us/op | indexed alloc us | "
        "find alloc us | failed allocs (indexed / find) | largest_free_run us (indexed / numpy scan) | "
        "free runs | frag |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w, (target, max_req) in WORKLOADS.items():
        for n in SIZES:
            i, f, lp = (by[(w, a, n)] for a in ("Indexed", "NaiveFind", "NaiveLoop"))
            lines.append(
                f"| {w} ({target:.0%}, 1..{max_req}) | {n} | {i['us_per_op']:.2f} | {f['us_per_op']:.2f} | "
                f"{lp['us_per_op']:.1f} | {i['us_per_alloc']:.2f} | {f['us_per_alloc']:.2f} | "
                f"{i['failed_allocs']}/{i['timed_ops']} / {f['failed_allocs']}/{f['timed_ops']} | "
                f"{i['us_per_largest_free_run']:.2f} / {f['us_per_largest_free_run']:.1f} | "
                f"{i['free_runs_end']} | {i['fragmentation_end']:.3f} |"
            )
    lines += [
        "",
        "- naive-find = first fit with `bytearray.find(bytes(n))` (a linear scan, in C); naive-loop = "
        "the same first fit as a per-block Python loop, timed over 300 steps only.",
        "- Failed allocations are timed too: the indexed allocator answers them from the size index "
        "without scanning; the naive ones scan the whole bitmap.",
        "- largest_free_run: the indexed allocator reads it off the size index in O(1); a bitmap "
        "allocator has to scan (here with NumPy, the fastest naive way).",
        "- Reading: the indexed cost depends on the number of free runs, not on N, so it stays at a few us "
        "for every pool size; the C scan is cheaper at these sizes but grows with N, the Python scan "
        "linearly. Naive free is an unchecked slice clear, while the indexed free also checks ref counts "
        "(double free) and coalesces neighbours. Best fit also fails fewer requests under pressure.",
        "- free runs / frag: the indexed allocator's free-run count and fragmentation at the end of the run.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

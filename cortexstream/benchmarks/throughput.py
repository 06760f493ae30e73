"""`cortexstream bench throughput`: what a user feels, CortexStream vs mlx-lm (issue #17).

Parts (`--parts`):
- matrix: wall time of the whole `batch_generate` call vs `mlx_lm.batch_generate` (same model object, same
  token-id prompts, greedy, alternating order, best and median of `rounds`) over kinds x concurrency x prompt
  tokens; per-cell peak memory, TTFT, identical outputs; a heat map of the ratio per cell.
- itl: inter-token latency of 8 running streams while a 2,048-token prompt is admitted (throughput_itl.py).
- single: `cortexstream.generate` vs `mlx_lm.generate`, whole-call wall time, 32- and 2,048-token prompts.
Targets are reported, never enforced. The report is rewritten after every finished cell (marked partial until
the end), and `--resume` measures only what an interrupted run of the same configuration left out
(throughput_progress.py).

Started as one of several ranks (mlx.launch, mpirun), every part runs with our engine on every rank and rank 0
writes the results; mlx-lm's rows are not measured there (throughput_ranks.py says why).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from cortexstream.benchmarks.throughput_prompts import KINDS

if TYPE_CHECKING:
    from cortexstream.benchmarks.throughput_progress import ThroughputResults

PARTS = ("matrix", "itl", "single")
# Why `run` refuses to start as one of several ranks without their session: see `refuse_ranks`.
ON_RANKS = ("throughput.run: mlx.launch or mpirun started this process as one of several ranks, and no ranks= "
            "(rank 0's DistributedSession) was given: it would time mlx-lm's generate and batch_generate on this "
            "rank alone, which cannot run on a model split over ranks. Run `cortexstream bench throughput` (or "
            "python -m cortexstream.benchmarks.throughput) under the launcher: it joins the ranks and measures our "
            "engine on them")


@dataclass(frozen=True)
class Settings:
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: tuple[int, ...] = (128, 1024)
    kinds: tuple[str, ...] = KINDS
    max_tokens: int = 64
    rounds: int = 3
    parts: tuple[str, ...] = PARTS
    max_minutes: float | None = None
    itl_streams: int = 8
    itl_stream_prompt_tokens: int = 128
    admit_tokens: int = 2048
    single_prompt_tokens: tuple[int, ...] = (32, 2048)
    seed: int = 0
    quick: bool = False
    ranks: int = 1  # processes the model is split over (mlx.launch, mpirun); 1: one process, mlx-lm measured too
    rank_backend: str | None = None  # the MLX backend connecting them ("ring", "mpi"); None in one process

    def __post_init__(self) -> None:
        from cortexstream.errors import InvalidArgumentError

        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise InvalidArgumentError(f"ranks: {self.ranks!r} must be an integer >= 1")
        if (self.ranks > 1) != (self.rank_backend is not None):
            raise InvalidArgumentError(f"rank_backend: {self.rank_backend!r} with ranks={self.ranks}: name the "
                                       "backend exactly when there are several ranks")


# --quick: 4 cells, still 3 rounds (alternating order needs more than one), the ITL and single parts unchanged.
QUICK = {"concurrency": (1, 8), "prompt_tokens": (128,), "kinds": ("equal", "shared")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `cortexstream bench throughput` (and `python -m cortexstream.benchmarks.throughput`)."""
    p.add_argument("--quick", action="store_true",
                   help="4 cells (concurrency 1,8 x 128 tokens x equal,shared), 3 rounds; writes throughput_quick.*")
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,8,32)")
    p.add_argument("--prompt-tokens", default=None, help="comma-separated prompt lengths (default 128,1024)")
    p.add_argument("--kinds", default=None, help="comma-separated: equal,ragged,shared (default all)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--rounds", "--repeats", type=int, default=3, help="alternating rounds per cell")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: matrix,itl,single")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start nothing new after this many minutes; what is skipped is listed in the results")
    p.add_argument("--itl-streams", type=int, default=8, help="running streams in the ITL part")
    p.add_argument("--admit-tokens", type=int, default=2048, help="length of the prompt admitted in the ITL part")
    p.add_argument("--single-prompt-tokens", default="32,2048", help="prompt lengths of the single-stream part")
    p.add_argument("--model", default=None, help="GGUF file, model directory or hub repo id (default: smollm2-135m)")
    p.add_argument("--out", default="bench/results", help="output folder")
    p.add_argument("--name", default=None,
                   help="file name stem of the results (default throughput, or throughput_quick with --quick)")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished cells of <out>/<name>.json (same configuration, else an error) and "
                        "measure only the rest")
    from cortexstream.cli.distributed import add_rank_args

    add_rank_args(p)  # under mlx.launch or mpirun: our engine on every rank, mlx-lm's rows skipped


def _ints(flag: str, text: str, minimum: int = 1) -> tuple[int, ...]:
    from cortexstream.errors import InvalidArgumentError

    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v < minimum for v in values):
        raise InvalidArgumentError(f"{flag}: '{text}' must be integers >= {minimum} separated by commas")
    return values


def _positive(flag: str, value: int) -> int:
    if value < 1:
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(f"{flag}: {value} must be an integer >= 1")
    return value


def _names(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    from cortexstream.cli.number_lists import name_list

    names = name_list(text)
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(f"{flag}: '{text}' must name some of {','.join(allowed)}")
    return names


def settings_from_args(a: argparse.Namespace) -> Settings:
    base = replace(Settings(), **QUICK, quick=True) if a.quick else Settings()
    return replace(
        base,
        concurrency=_ints("--concurrency", a.concurrency) if a.concurrency else base.concurrency,
        prompt_tokens=_ints("--prompt-tokens", a.prompt_tokens, 4) if a.prompt_tokens else base.prompt_tokens,
        kinds=_names("--kinds", a.kinds, KINDS) if a.kinds else base.kinds,
        max_tokens=_positive("--max-tokens", a.max_tokens), rounds=_positive("--rounds", a.rounds),
        parts=_names("--parts", a.parts, PARTS), max_minutes=a.max_minutes,
        itl_streams=_positive("--itl-streams", a.itl_streams), admit_tokens=_positive("--admit-tokens", a.admit_tokens),
        single_prompt_tokens=_ints("--single-prompt-tokens", a.single_prompt_tokens),
    )


def refuse_ranks() -> None:
    """InvalidArgumentError when a launcher started this process as one rank of several and `run` got no session:
    every rank would run the whole benchmark on its own, mlx-lm's calls included."""
    from cortexstream.distributed import launched

    if launched():
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(ON_RANKS)


def model_description(model: Any, source: str | None) -> dict[str, Any]:
    """The model by name, never by a local path (results are committed and shared)."""
    from cortexstream.benchmarks.machine import model_record, neutral_source
    from cortexstream.models.loader import model_info

    if model_info(model) is None:
        return {"source": neutral_source(source) if source else "unknown"}
    return model_record(model)


def _units(s: Settings) -> list[tuple[str, Any]]:
    from cortexstream.benchmarks.throughput_matrix import planned_cells

    units: list[tuple[str, Any]] = []
    if "itl" in s.parts:
        units.append(("itl", None))
    if "single" in s.parts:
        units += [("single", n) for n in s.single_prompt_tokens]
    if "matrix" in s.parts:
        units += [("matrix", cell) for cell in planned_cells(s.kinds, s.concurrency, s.prompt_tokens)]
    return units


def _label(part: str, what: Any) -> str:
    if part == "matrix":
        kind, c, n = what
        return f"{kind} c={c} prompt={n}"
    return "itl under admission" if part == "itl" else f"single prompt={what}"


def run(model_source: str | None, out_dir: str, settings: Settings, model: Any = None, tokenizer: Any = None,
        progress: bool = True, name: str | None = None, resume: bool = False, ranks: Any = None) -> dict[str, Any]:
    """Run the selected parts and write `<out>/<name>.{json,md,png}` (default name: throughput[_quick]) after
    every finished unit, partial until the end; `resume` keeps the units an earlier run of the same configuration
    finished. Returns the payload. `ranks`: rank 0's DistributedSession over the (split) `model`, whose size and
    backend `settings` record: our engine's rows only (throughput_ranks.py)."""
    from cortexstream.atomic_files import check_output_dir
    from cortexstream.backend import ensure_buffer_cache
    from cortexstream.benchmarks.machine import machine
    from cortexstream.benchmarks.throughput_progress import ThroughputResults
    from cortexstream.benchmarks.throughput_prompts import text_windows
    from cortexstream.benchmarks.throughput_matrix import warm_up
    from cortexstream.benchmarks.throughput_single import warm_up_single

    if ranks is None:
        refuse_ranks()  # before the model loads
    elif settings.ranks != ranks.size:
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(f"settings.ranks: {settings.ranks} for a session of {ranks.size} ranks")
    check_output_dir(out_dir)  # fail in a second, not after a 30-minute run
    name = name or ("throughput_quick" if settings.quick else "throughput")
    results = ThroughputResults(out_dir, name, asdict(settings), resume)  # a mismatch fails before loading
    if model is None:
        from cortexstream.models.loader import load

        model, tokenizer = load(model_source)
    # The engine raises MLX's process-wide buffer-cache limit when it is built; set it once up front so mlx-lm
    # runs under the same limit in every round, not only in rounds after a CortexStream call.
    ensure_buffer_cache()
    started = time.perf_counter()
    warm_up(model, tokenizer, text_windows(tokenizer, 2, 32), ranks)
    if "single" in settings.parts:
        warm_up_single(model, tokenizer, ranks)
    payload: dict[str, Any] = {
        "benchmark": name,
        "machine": machine(),
        "model": model_description(model, model_source),
        "settings": asdict(settings),
        "matrix": [], "itl": None, "single": [], "skipped": [],
    }
    if ranks is not None:
        from cortexstream.benchmarks.throughput_ranks import ANCHORS_SKIPPED

        payload["mlx_lm_skipped"] = ANCHORS_SKIPPED
    units = _units(settings)
    results.begin(payload, sum(part == "matrix" for part, _ in units))
    bar = _Progress(progress, len(units))
    try:
        _run_units(model, tokenizer, settings, units, payload, bar, started, results, ranks)
    finally:
        bar.close()
    results.save(payload, started, complete=True)
    return payload


def _run_units(model: Any, tokenizer: Any, settings: Settings, units: list[tuple[str, Any]],
               payload: dict[str, Any], bar: "_Progress", started: float, results: "ThroughputResults",
               ranks: Any = None) -> None:
    from cortexstream.benchmarks.throughput_itl import measure_itl
    from cortexstream.benchmarks.throughput_matrix import measure_cell
    from cortexstream.benchmarks.throughput_single import measure_single

    for part, what in units:
        label = _label(part, what)
        if results.take_earlier(payload, part, what):
            bar.advance(label + " (kept from the earlier run)")
            continue
        minutes = (time.perf_counter() - started) / 60
        if settings.max_minutes is not None and minutes >= settings.max_minutes:
            payload["skipped"].append(label)
            bar.advance(label + " (skipped)")
            continue
        bar.describe(label)
        on_ranks = {} if ranks is None else {"ranks": ranks}  # our engine on every rank, our rows alone
        if part == "matrix":
            kind, c, n = what
            result = measure_cell(model, tokenizer, kind, c, n, settings.max_tokens, settings.rounds, settings.seed,
                                  **on_ranks)
        elif part == "itl":
            result = measure_itl(model, tokenizer, settings.itl_streams, settings.itl_stream_prompt_tokens,
                                 settings.admit_tokens, settings.rounds, **on_ranks)
        else:
            result = measure_single(model, tokenizer, what, settings.max_tokens, settings.rounds, **on_ranks)
        results.add(payload, part, result, started)  # the partial report, rewritten atomically
        bar.advance(label)


class _Progress:
    """A rich progress bar over the benchmark's units (cells, ITL, single prompts), or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar = None
        if enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=False)
            self._bar.start()
            self._task = self._bar.add_task("throughput", total=total)

    def describe(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=label)

    def advance(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=label)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def run_from_args(a: argparse.Namespace) -> int:
    settings = settings_from_args(a)
    name = getattr(a, "name", None)
    if name is not None and (not name or any(c in name for c in "/\\.") or name.startswith("-")):
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(f"--name: '{name}' must be a plain file name stem (no '/', '\\' or '.')")
    from cortexstream.cli.distributed import check_rank_args
    from cortexstream.distributed import launched

    check_rank_args(a)  # --rank-timeout, --rank-backend: before the model loads
    resume = getattr(a, "resume", False)
    if launched():  # one of several ranks: our engine on every rank, rank 0 measures and writes
        from cortexstream.benchmarks.throughput_ranks import join_ranks

        joined = join_ranks(a)
        session = joined.session
        if not session.is_leader:
            session.follow()  # until rank 0 leaves the session
            return 0
        with session:  # leaving it stops the other ranks (with the error, when the run failed)
            payload = run(a.model, a.out, replace(settings, ranks=session.size, rank_backend=joined.backend),
                          model=joined.model, tokenizer=joined.tokenizer, name=name, resume=resume, ranks=session)
    else:
        payload = run(a.model, a.out, settings, name=name, resume=resume)
    from cortexstream.benchmarks.common import show_report

    return show_report(a.out, payload["benchmark"])


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.throughput")


if __name__ == "__main__":
    raise SystemExit(main())

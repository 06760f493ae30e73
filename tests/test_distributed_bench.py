"""`cortexstream bench throughput` on two ranks on this machine (ring backend over 127.0.0.1, the ranks started as
mlx.launch starts them), on the tiny model split over them, at sizes far below --quick's:

- both ranks end with status 0 within a bounded time; rank 0 prints the report, rank 1 prints nothing;
- rank 0 writes the JSON and the Markdown and nothing else (no heat map: it shows ratios to mlx-lm);
- the settings record 2 ranks over ring; every matrix, ITL and single-stream unit was measured, the rows are our
  engine's alone (no mlx-lm row, ratio or target) and say why mlx-lm is skipped;
- the rows are consistent with one process's run of the same options: the same cells, the same tokens generated.

No timing is checked: the figures of such a run are not reported anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_distributed import ring, split_model, start_ranks  # noqa: F401

CLI = str(Path(sys.executable).parent / "cortexstream")
SMALL = ["--quick", "--concurrency", "2", "--prompt-tokens", "16", "--kinds", "equal,shared", "--max-tokens", "4",
         "--rounds", "1", "--itl-streams", "2", "--admit-tokens", "32", "--single-prompt-tokens", "8"]
WITHIN = 120.0  # seconds the two ranks may take to load, join, run the small benchmark and stop


def outputs(procs: list[subprocess.Popen], within: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process; kills them all if they take longer than `within` seconds."""
    deadline = time.monotonic() + within
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"the ranks did not end within {within:g} s")
        results.append((proc.returncode, out, err))
    return results


def test_bench_throughput_on_two_ranks_writes_our_rows_with_the_rank_count(ring, split_model):  # noqa: F811
    alone_out = ring / "bench-alone"
    subprocess.run([CLI, "bench", "throughput", "--model", split_model, *SMALL, "--out", str(alone_out)],
                   check=True, capture_output=True, timeout=WITHIN)
    alone = json.loads((alone_out / "throughput_quick.json").read_text())

    out = ring / "bench-ranks"
    procs = start_ranks(ring, "bench", "throughput", "--model", split_model, *SMALL, "--out", str(out),
                        "--rank-timeout", "30", program=CLI)
    (code0, out0, err0), (code1, out1, err1) = outputs(procs, WITHIN)
    assert (code0, code1) == (0, 0), (err0[-2000:], err1[-2000:])
    assert "mlx-lm not measured" in out0 and out1 == ""  # rank 0 prints the report; rank 1 only followed
    assert sorted(p.name for p in out.iterdir()) == ["throughput_quick.json", "throughput_quick.md"]
    data = json.loads((out / "throughput_quick.json").read_text())
    report = (out / "throughput_quick.md").read_text()

    settings = data["settings"]
    assert settings["ranks"] == 2 and settings["rank_backend"] == "ring"
    assert alone["settings"]["ranks"] == 1 and alone["settings"]["rank_backend"] is None
    assert {k: v for k, v in settings.items() if k not in ("ranks", "rank_backend")} == \
        {k: v for k, v in alone["settings"].items() if k not in ("ranks", "rank_backend")}
    assert data["complete"] is True and data["skipped"] == [] and data["heatmap"] is None
    assert "several ranks" in data["mlx_lm_skipped"] and "mlx-lm not measured" in report
    assert "# Throughput on 2 ranks (ring backend)" in report

    def cells(payload):
        return {(c["kind"], c["concurrency"], c["prompt_tokens"]): c for c in payload["matrix"]}

    ours, theirs = cells(data), cells(alone)
    assert set(ours) == set(theirs) == {("equal", 2, 16), ("shared", 2, 16)}
    for key, cell in ours.items():
        assert set(cell) == {"kind", "concurrency", "prompt_tokens", "max_tokens", "rounds", "prompts",
                             "cortexstream"}  # our engine's row alone: no mlx-lm row, ratio or target
        assert len(cell["cortexstream"]["wall_s"]) == 1 and cell["cortexstream"]["peak_memory_gb"] > 0
        assert cell["cortexstream"]["generated_tokens"] == theirs[key]["cortexstream"]["generated_tokens"] > 0
        assert "mlx_lm" in theirs[key] and "ratio_median" in theirs[key]  # one process still measures mlx-lm
    assert data["itl"]["streams"] == 2 and data["itl"]["window"]["count"] > 0
    assert [set(r) for r in data["single"]] == [{"prompt_tokens", "max_tokens", "rounds", "cortexstream"}]
    assert data["single"][0]["prompt_tokens"] == 8 and "mlx_lm" in alone["single"][0]


def test_resume_tells_ranks_from_one_process(tmp_path):
    """A results file written before the settings recorded ranks resumes as one process's; a run on ranks does not
    continue a one-process file, nor the other way round (in-process: no rank is started)."""
    from dataclasses import asdict, replace

    from cortexstream.benchmarks.throughput import Settings
    from cortexstream.benchmarks.throughput_progress import ThroughputResults
    from cortexstream.errors import InvalidArgumentError

    alone, ranks = Settings(quick=True), Settings(quick=True, ranks=2, rank_backend="ring")
    older = {k: v for k, v in asdict(alone).items() if k not in ("ranks", "rank_backend")}
    (tmp_path / "older.json").write_text(json.dumps({"settings": older, "matrix": []}))
    ThroughputResults(str(tmp_path), "older", asdict(alone), resume=True)
    with pytest.raises(InvalidArgumentError, match="its setting rank_backend is None, this run's is 'ring'"):
        ThroughputResults(str(tmp_path), "older", asdict(ranks), resume=True)
    (tmp_path / "ranked.json").write_text(json.dumps({"settings": asdict(ranks), "matrix": []}))
    ThroughputResults(str(tmp_path), "ranked", asdict(ranks), resume=True)
    with pytest.raises(InvalidArgumentError, match="its setting rank_backend is 'ring', this run's is None"):
        ThroughputResults(str(tmp_path), "ranked", asdict(alone), resume=True)
    for bad in ({"ranks": 0}, {"ranks": 2}, {"rank_backend": "ring"}):
        with pytest.raises(InvalidArgumentError, match="rank"):
            replace(alone, **bad)

"""Fuzzing every file reader (GGUF, prompt caches, torch checkpoints, InfiniLM .bin, safetensors) in a worker
subprocess: a crash (SIGSEGV) or a hang is a failure, and so is a foreign exception instead of a clear error.

Quick form: a few dozen cases per format in the normal run. Long form (thousands of cases per format):
`pytest -m fuzz tests/test_fuzz_files.py` (CORTEXSTREAM_FUZZ_CASES sets the number, default 1000), or
`python tests/fuzz_harness.py --cases 1000`, which also writes bench/results/fuzz.json and fuzz.md.
"""

from __future__ import annotations

import os

import pytest

from fuzz_harness import FORMATS, Worker, base_files, fuzz_format

QUICK_CASES = 40


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fuzz"))
    return directory, base_files(directory)


@pytest.fixture(scope="module")
def worker():
    w = Worker(timeout=30.0)
    yield w
    w.close()


def check(report) -> None:
    bad = [f"{outcome}: {detail}" for outcome, _, detail in report.findings]
    assert not bad, f"{report.fmt}: {len(bad)} of {report.cases} cases failed:\n" + "\n".join(bad[:10])
    assert report.cases > 0 and report.counts["rejected"] > 0


def test_the_harness_catches_crashes_and_hangs(tmp_path):
    path = str(tmp_path / "x")
    open(path, "wb").close()
    worker = Worker(timeout=2.0)
    try:
        assert worker.parse("selftest-crash", path)[0] == "crash"
        assert worker.parse("selftest-hang", path)[0] == "hang"
        worker.timeout = 120.0  # the restarted worker imports MLX first, slow on a busy machine
        assert worker.parse("gguf", path)[0] == "rejected"  # restarted after both
    finally:
        worker.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_valid_base_files_parse(fmt, bases, worker):
    directory, files = bases
    suffix = {"gguf": ".gguf", "torch": ".pth", "torch_legacy": ".pt", "infinilm": ".bin"}.get(fmt, ".safetensors")
    path = os.path.join(directory, f"valid-{fmt}{suffix}")
    with open(path, "wb") as fh:
        fh.write(files[fmt])
    assert worker.parse(fmt, path) == ("ok", "")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quick_fuzz(fmt, bases, worker):
    directory, files = bases
    check(fuzz_format(fmt, QUICK_CASES, worker, files[fmt], directory))


@pytest.mark.fuzz
@pytest.mark.parametrize("fmt", FORMATS)
def test_long_fuzz(fmt, bases, worker, request):
    if "fuzz" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("long form: run with -m fuzz")
    directory, files = bases
    cases = int(os.environ.get("CORTEXSTREAM_FUZZ_CASES", "1000"))
    report = fuzz_format(fmt, cases, worker, files[fmt], directory)
    print(f"{fmt}: {dict(report.counts)}")
    check(report)
    assert report.cases == cases

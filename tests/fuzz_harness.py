"""File fuzzer: hypothesis mutates valid files of each format, a worker subprocess parses them with the real
readers, and every case is classified: ok / rejected (a CortexStreamError) / raw (a foreign exception) / crash
(the worker died, e.g. SIGSEGV) / hang (no answer within the timeout).

Used by tests/test_fuzz_files.py (quick form in the normal run, long form under `-m fuzz`) and as a script that
writes bench/results/fuzz.json + fuzz.md:  python tests/fuzz_harness.py --cases 1000
"""

from __future__ import annotations

import io
import json
import os
import platform
import select
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
FORMATS = ("gguf", "prompt_cache", "torch", "torch_legacy", "infinilm", "safetensors")
INTERESTING = (0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 63, 64, 255, 256, 4096, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


@dataclass
class Report:
    fmt: str
    counts: Counter = field(default_factory=Counter)
    findings: list[tuple[str, str, str]] = field(default_factory=list)  # (outcome, saved file, detail)

    @property
    def cases(self) -> int:
        return sum(self.counts.values())


class Worker:
    """A long-lived parser subprocess, restarted after a crash or a hang."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = {**os.environ, "CORTEXSTREAM_NO_OPENBLAS": "1", "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fuzz_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def parse(self, fmt: str, path: str) -> tuple[str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{fmt}\t{path}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self.close()
            return "hang", f"no answer within {self.timeout} s"
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return "crash", f"worker exited with code {code}"
        kind, _, detail = line.rstrip("\n").partition("\t")
        return kind, detail

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


# --- valid base files --------------------------------------------------------------------------------------------

def base_files(directory: str) -> dict[str, bytes]:
    """One small valid file per format, built with the project's own writers (and torch.save for torch)."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, HERE)
    from tiny_models import tiny_model, write_tiny_gguf

    from cortexstream.kv.prompt_cache import make_prompt_cache, save_prompt_cache
    from cortexstream.port import write_infinilm_bin

    out: dict[str, bytes] = {}
    gguf_path = os.path.join(directory, "base.gguf")
    model = tiny_model(seed=7)
    write_tiny_gguf(gguf_path, model)
    out["gguf"] = open(gguf_path, "rb").read()
    cache = make_prompt_cache(model)
    model(mx.array([[3, 4, 5, 6]]), cache=cache)
    cache_path = os.path.join(directory, "base.safetensors")
    save_prompt_cache(cache_path, cache)
    out["prompt_cache"] = open(cache_path, "rb").read()
    d, f = 4, 2
    state = {f"{p}.0.{s}.weight": mx.ones((d, d * f if s == 0 else d)) for p in ("compress_tk", "compress_tv")
             for s in (0, 3, 6)}
    state.update({f"{p}.0.{s}.bias": mx.zeros((d,)) for p in ("compress_tk", "compress_tv") for s in (0, 3, 6)})
    bin_path = os.path.join(directory, "base.bin")
    write_infinilm_bin(bin_path, state, dtype="float32")
    out["infinilm"] = open(bin_path, "rb").read()
    st_path = os.path.join(directory, "weights.safetensors")
    mx.save_safetensors(st_path, {"a": mx.ones((3, 4)), "b": mx.zeros((2,), dtype=mx.float16)}, metadata={"k": "v"})
    out["safetensors"] = open(st_path, "rb").read()
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save({"w": base, "t": base.t(), "row": base[1], "h": torch.ones(3, dtype=torch.float16)}, buf)
    out["torch"] = buf.getvalue()
    legacy = io.BytesIO()
    torch.save({"w": base, "row": base[1]}, legacy, _use_new_zipfile_serialization=False)
    out["torch_legacy"] = legacy.getvalue()
    del np
    return out


# --- mutations ---------------------------------------------------------------------------------------------------

def _header_end(fmt: str, data: bytes) -> int:
    """Where a format's structure ends (mutations go mostly there: tensor payload bytes are not interesting)."""
    if fmt in ("prompt_cache", "safetensors"):
        return 8 + struct.unpack("<Q", data[:8])[0]
    if fmt == "gguf":
        sys.path.insert(0, os.path.dirname(HERE))
        from cortexstream.models.gguf_check import _Cursor, _walk  # noqa: PLC2701 - test-only use

        return _walk(_Cursor(data, "base"), len(data)).data_offset
    return len(data)


def mutation_strategy(fmt: str, data: bytes):
    """A hypothesis strategy of mutated files for `fmt` built from its valid `data`."""
    from hypothesis import strategies as st

    end = max(_header_end(fmt, data), 16)
    position = st.integers(0, end - 1) | st.integers(0, len(data) - 1)
    width = st.sampled_from([1, 2, 4, 8])
    value = st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)
    ops = st.one_of(
        st.tuples(st.just("flip"), position, st.integers(1, 255)),
        st.tuples(st.just("set"), position, width, value),
        st.tuples(st.just("truncate"), st.integers(0, len(data))),
        st.tuples(st.just("insert"), position, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), position, st.integers(1, 16)),
    )
    byte_level = st.lists(ops, min_size=1, max_size=4).map(lambda edits: _apply(data, edits))
    if fmt == "prompt_cache":
        return byte_level | _metadata_strategy(data) | _safetensors_header_strategy(data)
    if fmt == "safetensors":
        return byte_level | _safetensors_header_strategy(data)
    if fmt == "torch":
        return byte_level | _pickle_strategy(data, ops)
    return byte_level


def _apply(data: bytes, edits: list[tuple]) -> bytes:
    buf = bytearray(data)
    for edit in edits:
        kind = edit[0]
        if kind == "truncate":
            del buf[edit[1]:]
            continue
        pos = min(edit[1], max(len(buf) - 1, 0))
        if kind == "flip" and buf:
            buf[pos] ^= edit[2]
        elif kind == "set":
            width, val = edit[2], edit[3] % (1 << (8 * edit[2]))
            buf[pos:pos + width] = val.to_bytes(width, "little")
        elif kind == "insert":
            buf[pos:pos] = edit[2]
        elif kind == "delete":
            del buf[pos:pos + edit[2]]
    return bytes(buf)


def _metadata_strategy(data: bytes):
    """Prompt caches: rewrite fields of the `cortexstream` metadata JSON with hostile values."""
    from hypothesis import strategies as st

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    info = json.loads(header["__metadata__"]["cortexstream"])
    scalar = st.one_of(st.integers(-2**70, 2**70), st.sampled_from(INTERESTING), st.text(max_size=5), st.none(),
                       st.booleans(), st.floats(allow_nan=True))
    hostile = scalar | st.lists(scalar, max_size=4) | st.lists(st.integers(-2**40, 2**40), min_size=0, max_size=6)
    changes = st.dictionaries(st.sampled_from(["format", "num_layers", "offsets", "lengths", "extra"]), hostile,
                              min_size=1, max_size=3)

    def rewrite(change: dict) -> bytes:
        new_info = {**info, **change}
        new_header = {**header, "__metadata__": {**header["__metadata__"], "cortexstream": json.dumps(new_info)}}
        raw = json.dumps(new_header).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + n:]

    return changes.map(rewrite)


def _safetensors_header_strategy(data: bytes):
    """Safetensors: rewrite one tensor entry's dtype, shape or data_offsets with hostile values."""
    from hypothesis import strategies as st

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    number = st.sampled_from(INTERESTING) | st.integers(-2**65, 2**65)
    hostile = st.one_of(
        st.tuples(st.just("shape"), st.lists(number, max_size=5)),
        st.tuples(st.just("data_offsets"), st.lists(number, min_size=0, max_size=3)),
        st.tuples(st.just("dtype"), st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64", "X", ""])),
        st.tuples(st.just("drop"), st.sampled_from(["shape", "data_offsets", "dtype"])),
    )
    edits = st.lists(st.tuples(st.sampled_from(names), hostile), min_size=1, max_size=3)

    def rewrite(changes: list) -> bytes:
        new_header = json.loads(json.dumps(header))
        for name, (key, val) in changes:
            if key == "drop":
                new_header[name].pop(val, None)
            else:
                new_header[name][key] = val
        raw = json.dumps(new_header).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + n:]

    return edits.map(rewrite)


def _pickle_strategy(data: bytes, ops):
    """Torch zips: mutate the pickle inside and re-zip with correct CRCs, so the reader's own rules are hit."""
    from hypothesis import strategies as st

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    pkl_name = next(name for name in members if name.endswith("data.pkl"))
    pkl = members[pkl_name]
    pkl_ops = st.lists(ops, min_size=1, max_size=3).map(
        lambda edits: [(e[0], e[1] % max(len(pkl), 1), *e[2:]) if e[0] != "truncate" else
                       ("truncate", e[1] % (len(pkl) + 1)) for e in edits])

    def rezip(edits: list[tuple]) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
            for name, payload in members.items():
                zf.writestr(name, _apply(pkl, edits) if name == pkl_name else payload)
        return out.getvalue()

    return pkl_ops.map(rezip)


# --- running -----------------------------------------------------------------------------------------------------

def fuzz_format(fmt: str, cases: int, worker: Worker, base: bytes, directory: str,
                keep_dir: str | None = None) -> Report:
    """Run `cases` hypothesis-generated mutations of `base` through the worker."""
    from hypothesis import HealthCheck, Phase, given, settings

    report = Report(fmt)
    suffix = {"gguf": ".gguf", "prompt_cache": ".safetensors", "safetensors": ".safetensors", "torch": ".pth",
              "torch_legacy": ".pt", "infinilm": ".bin"}[fmt]
    path = os.path.join(directory, f"case{suffix}")

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(mutation_strategy(fmt, base))
    def one(mutated: bytes) -> None:
        with open(path, "wb") as fh:
            fh.write(mutated)
        outcome, detail = worker.parse(fmt, path)
        report.counts[outcome] += 1
        if outcome in ("crash", "hang", "raw"):
            saved = ""
            if keep_dir:
                os.makedirs(keep_dir, exist_ok=True)
                saved = os.path.join(keep_dir, f"{fmt}-{outcome}-{report.counts[outcome]}{suffix}")
                with open(saved, "wb") as fh:
                    fh.write(mutated)
            report.findings.append((outcome, saved, detail))

    one()
    return report


def run_all(cases: int, formats: tuple[str, ...] = FORMATS, keep_dir: str | None = None) -> list[Report]:
    with tempfile.TemporaryDirectory() as directory:
        bases = base_files(directory)
        worker = Worker()
        try:
            return [fuzz_format(fmt, cases, worker, bases[fmt], directory, keep_dir) for fmt in formats]
        finally:
            worker.close()


def write_results(reports: list[Report], out_dir: str, seconds: float, notes: list[str] | None = None) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from cortexstream.atomic_files import write_json_atomic, write_text_atomic

    os.makedirs(out_dir, exist_ok=True)
    machine = f"{os.cpu_count()} cores, {platform.machine()}, {platform.system()}"
    payload = {
        "benchmark": "fuzz", "machine": machine, "seconds": round(seconds, 1),
        "command": "python tests/fuzz_harness.py --cases N (or pytest -m fuzz tests/test_fuzz_files.py)",
        "notes": list(notes or []),
        "formats": {r.fmt: {"cases": r.cases, **{k: r.counts.get(k, 0) for k in
                                                  ("ok", "rejected", "raw", "crash", "hang")},
                            "findings": [d for _, _, d in r.findings][:20]} for r in reports},
    }
    write_json_atomic(os.path.join(out_dir, "fuzz.json"), payload)
    lines = ["# File fuzzing", "", f"Machine: {machine}. Wall time {seconds / 60:.1f} min.", "",
             "Each case is a hypothesis-generated mutation of a small valid file, parsed by the project's own reader "
             "in a worker subprocess (`tests/fuzz_worker.py`), so a SIGSEGV is caught as a crash and a stuck parse "
             "as a hang (30 s timeout). ok = accepted, rejected = a clear CortexStreamError, raw = any other "
             "exception.", "", "| format | cases | ok | rejected | raw | crash | hang |", "|---|---|---|---|---|---|---|"]
    for r in reports:
        c = r.counts
        lines.append(f"| {r.fmt} | {r.cases} | {c['ok']} | {c['rejected']} | {c['raw']} | {c['crash']} | "
                     f"{c['hang']} |")
    lines += ["", *[f"- {note}" for note in notes or []]] if notes else []
    write_text_atomic(os.path.join(out_dir, "fuzz.md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases per format")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "bench", "results"))
    parser.add_argument("--keep", default=None, help="folder to save crashing / raw-error files in")
    parser.add_argument("--note", action="append", default=[], help="a line added to the report (repeatable)")
    args = parser.parse_args()
    start = time.time()
    results = run_all(args.cases, tuple(args.formats.split(",")), args.keep)
    write_results(results, args.out, time.time() - start, args.note)
    for r in results:
        print(r.fmt, dict(r.counts), *[f"\n  {o}: {d}" for o, _, d in r.findings[:10]])

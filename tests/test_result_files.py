"""Files the project writes appear whole or not at all; torn or missing ones are errors that name the file;
output folders are checked before a long run (issue #24 repro 10)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cortexstream.atomic_files import atomic_write, check_output_dir, read_json_file, write_json_atomic
from cortexstream.errors import InvalidArgumentError, ModelLoadError


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = str(tmp_path / "r.json")
    write_json_atomic(path, {"a": 1})

    def half_then_fail(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write('{"a": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert read_json_file(path) == {"a": 1} and os.listdir(tmp_path) == ["r.json"]


def test_atomic_files_get_ordinary_permissions(tmp_path):
    path = str(tmp_path / "p.json")
    write_json_atomic(path, [1])
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_torn_or_missing_json_names_the_file(tmp_path):
    torn = tmp_path / "t.json"
    torn.write_text('{"perplexity": [')
    with pytest.raises(ModelLoadError, match=rf"{torn}: results file is unreadable or torn"):
        read_json_file(str(torn), "results file")
    with pytest.raises(ModelLoadError, match="missing.json: state not found"):
        read_json_file(str(tmp_path / "missing.json"), "state")


def test_output_folder_is_created_or_refused_up_front(tmp_path):
    assert check_output_dir(str(tmp_path / "new" / "dir")) and (tmp_path / "new" / "dir").is_dir()
    with pytest.raises(InvalidArgumentError, match="--out: /proc/nope: cannot write results there"):
        check_output_dir("/proc/nope")


def _result_stores():
    """The benchmarks' one resumable result store, as a (path, settings, resume) constructor."""
    from cortexstream.benchmarks.result_store import ResultStore

    return [lambda path, settings, resume: ResultStore(path, "quality", settings, ["perplexity"], resume=resume)]


def test_bench_resume_on_a_torn_results_file_names_it(tmp_path):
    torn = tmp_path / "q.json"
    torn.write_text('{"perplexity": [')
    for store in _result_stores():
        with pytest.raises(ModelLoadError, match=rf"{torn}: results file is unreadable"):
            store(str(torn), {}, resume=True)


def test_training_resume_on_torn_state_or_missing_optimizer_names_the_file(tmp_path):
    loop = pytest.importorskip("cortexstream.training.loop")
    (tmp_path / "state.json").write_text('{"train": {"st')
    with pytest.raises(ModelLoadError, match=r"state.json: training state is unreadable or torn"):
        loop.load_resumable(str(tmp_path), {"steps": 1})
    with pytest.raises(ModelLoadError, match=r"optimizer.safetensors: file not found"):
        loop.load_optimizer_state(str(tmp_path), None)


def test_bench_with_an_unwritable_out_fails_before_running():
    env = {**os.environ, "CORTEXSTREAM_NO_OPENBLAS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "cortexstream.cli.main", "bench", "throughput", "--out", "/proc/nope"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr.strip() == ("cortexstream: error: --out: /proc/nope: cannot write results there "
                                     "(No such file or directory)")


def test_weight_writers_are_atomic(tmp_path, monkeypatch):
    import mlx.core as mx

    from cortexstream.port import save_safetensors, save_torch
    from cortexstream.port import torch_save

    st_path, pt_path = str(tmp_path / "w.safetensors"), str(tmp_path / "w.pth")
    save_safetensors(st_path, {"a": mx.ones((2,))})
    save_torch(pt_path, {"a": mx.ones((2,))})
    before = {p: open(p, "rb").read() for p in (st_path, pt_path)}

    def torn_safetensors(path, *args, **kwargs):
        open(path, "wb").write(b"\x08\x00")
        raise OSError("disk full")

    calls = []

    def torn_zip(*args):
        calls.append(args)
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", torn_safetensors)
    monkeypatch.setattr(torch_save, "_write_aligned", torn_zip)
    for write, path in ((lambda: save_safetensors(st_path, {"a": mx.zeros((3,))}), st_path),
                        (lambda: save_torch(pt_path, {"a": mx.zeros((3,))}), pt_path)):
        with pytest.raises(OSError, match="disk full"):
            write()
        assert open(path, "rb").read() == before[path]
    assert sorted(os.listdir(tmp_path)) == ["w.pth", "w.safetensors"]


def test_train_with_an_unwritable_out_fails_before_loading(capsys):
    from cortexstream.cli.main import main

    assert main(["train", "compressor", "--out", "/proc/nope", "--model", "/never-loaded.gguf"]) == 1
    assert capsys.readouterr().err.strip() == ("cortexstream: error: --out: /proc/nope: cannot write results there "
                                               "(No such file or directory)")


def test_torn_training_caches_are_named(tmp_path):
    from cortexstream.training.c2c import data as c2c_data
    from cortexstream.training.compression.data import TeacherPool

    torn = tmp_path / "cache.safetensors"
    torn.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\": {\"dtype\": \"F32\"")
    with pytest.raises(ModelLoadError, match=rf"{torn}: malformed safetensors"):
        c2c_data._load(str(torn), {})
    with pytest.raises(ModelLoadError, match=rf"{torn}: malformed safetensors"):
        TeacherPool.cached(str(torn), "fp", lambda: pytest.fail("rebuilt instead of reporting"))


def test_torn_trajectory_index_is_named(tmp_path):
    from cortexstream.training.sidecar import cli as sidecar_cli

    (tmp_path / "index.json").write_text('{"collect": {')
    with pytest.raises(ModelLoadError, match=r"index.json: trajectory index is unreadable or torn"):
        sidecar_cli._complete(str(tmp_path), {}, 1, "wiki")

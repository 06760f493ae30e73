"""Benchmark options are parsed and range-checked before anything loads, each error naming the option."""

from __future__ import annotations

import pytest

from cortexstream.cli.main import main
from cortexstream.cli.number_lists import fraction_list, int_list
from cortexstream.errors import InvalidArgumentError


@pytest.mark.parametrize("argv, message", [
    (["quality", "--contexts", "abc"], "--contexts: 'abc' must be integers >= 16"),
    (["quality", "--contexts", "8"], "--contexts: '8' must be integers >= 16"),
    (["quality", "--budgets", "x"], "--budgets: 'x' must be fractions in (0, 1]"),
    (["quality", "--budgets", "0.2,1.5"], "--budgets: '0.2,1.5' must be fractions"),
    (["quality", "--ppl-chunk", "0"], "--ppl-chunk: 0 must be >= 1"),
    (["frontier", "--contexts", "abc"], "--contexts: 'abc' must be integers >= 16"),
    (["frontier", "--chunk", "0"], "--chunk: 0 must be >= 1"),
    (["quality", "--parts", "perplexity,nope"], "--parts: ['nope'] are not among"),
    (["frontier", "--needle-trials", "0"], "--needle-trials: 0 must be >= 1"),
])
def test_bad_bench_options_fail_before_loading(tmp_path, capsys, argv, message):
    assert main(["bench", *argv, "--model", str(tmp_path / "never-loaded.gguf"), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"cortexstream: error: {message}" or (err.startswith("cortexstream: error: ") and message in err)
    assert "never-loaded" not in err


def test_number_lists():
    assert int_list("16, 32,", "--x", 16) == (16, 32)
    assert fraction_list("0.1,1", "--y") == (0.1, 1.0)
    for bad in ("", "nan", "0", "-0.5"):
        with pytest.raises(InvalidArgumentError, match="--y"):
            fraction_list(bad, "--y")

"""TUI options are checked before the screen starts, the arena size against this machine's memory with the
numbers in the error (issue #24 repro 12)."""

from __future__ import annotations

import pytest

from cortexstream.cli.main import main
from cortexstream.cli.preflight import check_kv_tokens, kv_bytes_per_token
from cortexstream.errors import InvalidArgumentError


@pytest.mark.parametrize("argv, fragment", [
    (["--temp", "-3"], "temperature: -3.0 is invalid"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--block-size", "0"], "--block-size: 0"),
    (["--kv-tokens", "0"], "--kv-tokens: 0 must be a positive integer"),
    (["--kv-tokens", "99999999999"], "--kv-tokens: 99999999999 tokens need"),
])
def test_bad_tui_options_fail_in_one_line_before_the_screen(tiny_gguf, capsys, monkeypatch, argv, fragment):
    import cortexstream.tui.app as app

    monkeypatch.setattr(app, "main", lambda args: pytest.fail("the TUI started"))
    assert main(["tui", "--model", tiny_gguf, *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cortexstream: error:") and fragment in err[0]


def test_kv_bytes_per_token_reads_the_gguf_header(tiny_gguf):
    # tiny model: 2 layers x 2 KV heads x head_dim 16, K and V, float32
    assert kv_bytes_per_token(tiny_gguf, 4) == 2 * 2 * 2 * 16 * 4


def test_the_memory_error_gives_the_numbers(tiny_gguf, monkeypatch):
    import cortexstream.kv.arena_config as arena_config

    monkeypatch.setattr(arena_config, "device_memory_bytes", lambda: 1 << 30)
    check_kv_tokens(1000, tiny_gguf)  # 1000 x 512 bytes fits in 1 GiB
    expected = (r"10000000 tokens need 4.8 GiB of KV arena \(512 bytes per token\), this machine has 1.0 GiB; "
                r"at most about 1887436 tokens fit")
    with pytest.raises(InvalidArgumentError, match=expected):
        check_kv_tokens(10_000_000, tiny_gguf)

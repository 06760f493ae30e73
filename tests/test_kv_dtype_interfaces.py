"""Quantized KV storage through the user interfaces: `--kv-dtype` / `--kv-group-size` on generate, chat, tui and
serve (bad values named by flag, before or right after the model loads), the storage table of `cortexstream info`,
the server's /v1/kv and /metrics on an int8 arena, the 400 for a request that asks for its own kv_dtype, and the
TUI's stats line."""

from __future__ import annotations

import asyncio
import io

import httpx
import pytest

from cortexstream.cli.kv_storage import flag_message, storage_lines, storage_rows
from cortexstream.cli.main import build_parser, main
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.server.config import ServerConfig
from server_harness import LiveServer
from tiny_models import TINY_CONFIG, tiny_model, write_tiny_gguf

COMMANDS = {  # the arguments each command needs besides the KV options
    "generate": ["--prompt", "x"],
    "chat": [],
    "tui": [],
    "serve": [],
}


@pytest.fixture(scope="module")
def model32():
    """The tiny model with 32-wide heads, which int8/int4 groups of 32 divide (the default tiny model's 16 do not)."""
    return tiny_model(seed=3, head_dim=32)


@pytest.fixture(scope="module")
def gguf32(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kv32") / "tiny32.gguf")
    write_tiny_gguf(path, tiny_model(seed=3, head_dim=32), config={**TINY_CONFIG, "head_dim": 32})
    return path


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("cortexstream: error:")
    return lines[0]


def int8_bytes_per_token(layers: int, kv_heads: int, head_dim: int, group: int, scale_bytes: int) -> int:
    """One byte per value plus a scale and a bias per group, for K and V of every layer and KV head."""
    return layers * kv_heads * 2 * (head_dim + 2 * (head_dim // group) * scale_bytes)


# --- command line -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_building_command_takes_the_kv_options(command):
    args = build_parser().parse_args([command, *COMMANDS[command], "--kv-dtype", "k=int8,v=int4",
                                      "--kv-group-size", "32"])
    assert (args.kv_dtype, args.kv_group_size) == ("k=int8,v=int4", 32)
    defaults = build_parser().parse_args([command, *COMMANDS[command]])
    assert (defaults.kv_dtype, defaults.kv_group_size) == (None, None)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_the_kv_dtypes_and_group_sizes(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for choice in ("auto", "float32", "float16", "bfloat16", "int8", "int4", "k=<type>,v=<type>"):
        assert choice in text, choice
    assert "--kv-group-size {32,64}" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_a_group_size_other_than_32_or_64_is_an_argparse_error(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, *COMMANDS[command], "--kv-group-size", "48"])
    assert exit_info.value.code == 2
    assert "argument --kv-group-size: invalid choice: 48" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("options, fragment", [
    (["--kv-dtype", "int9"], "--kv-dtype: 'int9' is not a KV dtype; choose auto, float32"),
    (["--kv-dtype", "k=int8"], "--kv-dtype: 'k=int8' lacks v=<type>"),
    (["--kv-dtype", "float16", "--kv-group-size", "32"], "--kv-group-size: 32 given, but --kv-dtype 'float16'"),
    (["--kv-group-size", "64"], "--kv-group-size: 64 given"),
])
def test_bad_kv_options_fail_in_one_line_before_the_model_loads(command, options, fragment, capsys, monkeypatch,
                                                               tmp_path):
    import cortexstream.tui.app as app

    monkeypatch.setattr(app, "main", lambda args: pytest.fail("the TUI started"))
    missing = str(tmp_path / "missing.gguf")  # loading it would fail with "not found" instead
    assert main([command, "--model", missing, *COMMANDS[command], *options]) == 1
    line = one_error_line(capsys)
    assert fragment in line and "not found" not in line


@pytest.mark.parametrize("command", ["generate", "chat", "tui"])
def test_a_group_that_does_not_divide_the_head_dim_names_the_flag(command, tiny_gguf, capsys, monkeypatch):
    import cortexstream.tui.app as app

    monkeypatch.setattr(app, "main", lambda args: pytest.fail("the TUI started"))
    monkeypatch.setattr("builtins.input", lambda prompt="": pytest.fail("the chat started"))
    assert main([command, "--model", tiny_gguf, *COMMANDS[command], "--kv-dtype", "int8"]) == 1
    line = one_error_line(capsys)
    assert "--kv-group-size: 64 does not divide the model's head_dim 16" in line


def test_flag_message_renames_only_the_keyword_arguments():
    assert flag_message("kv_group_size: 64 does not divide; use kv_group_size=32 or a float kv_dtype") == (
        "--kv-group-size: 64 does not divide; use --kv-group-size=32 or a float --kv-dtype")
    assert flag_message("ArenaConfig.kv_dtype: x") == "ArenaConfig.kv_dtype: x"


def test_generate_passes_the_storage_to_stream_generate(gguf32, capsys, monkeypatch):
    import cortexstream.generation.stream as stream

    real, seen = stream.stream_generate, {}

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(stream, "stream_generate", recording)
    assert main(["generate", "--model", gguf32, "--prompt", "the cat", "-m", "4", "--kv-dtype", "int8",
                 "--kv-group-size", "32"]) == 0
    assert (seen["kv_dtype"], seen["kv_group_size"]) == ("int8", 32)
    assert capsys.readouterr().out.strip()


def test_chat_caches_store_the_chosen_dtype(model32, tiny):
    from cortexstream.cli.commands import _ChatCache

    chat = _ChatCache(model32, tiny[1], None, "k=int8,v=int4", 32)
    chat.turn_tokens([{"role": "user", "content": "hello"}])
    assert chat.cache[0].sequence.arena.config.cache_key.startswith("k=int8,v=int4,group=32,")


# --- cortexstream info ----------------------------------------------------------------------------------------------
def test_info_storage_rows_fall_back_to_group_32_or_say_not_available(model32):
    rows = {row.label: row for row in storage_rows(model32)}
    assert list(rows) == ["float32 (model)", "float16", "int8 (group 32)", "int4 (group 32)"]
    layers, kv_heads = TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_key_value_heads"]
    assert rows["float32 (model)"].bytes_per_token == layers * kv_heads * 2 * 32 * 4
    assert rows["float16"].bytes_per_token == layers * kv_heads * 2 * 32 * 2
    assert rows["int8 (group 32)"].bytes_per_token == int8_bytes_per_token(layers, kv_heads, 32, 32, 4)
    assert rows["int8 (group 32)"].tokens_per_gib == 2**30 // rows["int8 (group 32)"].bytes_per_token
    assert "group 64 does not divide head dim 32" in rows["int4 (group 32)"].note
    narrow = {row.label: row for row in storage_rows(tiny_model(seed=3))}  # head dim 16: no group divides it
    assert narrow["int8"].bytes_per_token is None and narrow["int8"].tokens_per_gib is None
    assert narrow["int8"].note.startswith("not available")
    wide = [row.label for row in storage_rows(tiny_model(seed=3, head_dim=64))]
    assert "int8 (group 64)" in wide and "int4 (group 64)" in wide


def test_info_prints_the_storage_table(gguf32, capsys):
    assert main(["info", "--model", gguf32]) == 0
    out = capsys.readouterr().out
    assert "kv storage" in out and "bytes/token" in out and "tokens/GiB" in out
    int8 = next(line for line in out.splitlines() if line.strip().startswith("int8 (group 32)"))
    expected = storage_rows(tiny_model(seed=3, head_dim=32))
    assert int8 in storage_lines(expected)


# --- server ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, option", [
    ({"kv_dtype": "int9"}, "kv_dtype"),
    ({"kv_dtype": 8}, "kv_dtype"),
    ({"kv_group_size": 32}, "kv_group_size"),
    ({"kv_dtype": "int8", "kv_group_size": 48}, "kv_group_size"),
])
def test_server_config_refuses_bad_storage_naming_the_option(options, option):
    with pytest.raises(ValueError, match=f"^{option}:"):
        ServerConfig(**options)


def test_server_arena_refuses_a_group_that_does_not_divide_the_head_dim(tiny):
    from cortexstream.server.app import build_engine

    with pytest.raises(InvalidArgumentError, match="^kv_group_size: 64 does not divide"):
        build_engine(tiny[0], tiny[1], ServerConfig(kv_tokens=256, kv_dtype="int8"))


@pytest.fixture(scope="module")
def int8_server(model32, tiny):
    with LiveServer(model32, tiny[1], kv_tokens=1024, kv_dtype="int8", kv_group_size=32) as live:
        yield live


def test_v1_kv_reports_the_storage_and_capacity(int8_server, model32):
    expected = ArenaConfig.for_model(model32, num_tokens=1024, kv_dtype="int8", kv_group_size=32)
    kv = httpx.get(f"{int8_server.url}/v1/kv").json()
    assert kv["kv_dtype"] == "int8"
    assert kv["bytes_per_token"] == expected.bytes_per_token
    assert kv["bytes_per_token"] == int8_bytes_per_token(2, 2, 32, 32, 4)
    assert kv["token_capacity"] == kv["num_blocks"] * kv["block_size"] == expected.num_slots >= 1024


def test_metrics_export_bytes_per_token_and_the_kv_dtype(int8_server):
    reply = int8_server.client().completions.create(model="tiny", prompt="int8 blocks", max_tokens=3,
                                                    temperature=0)
    assert reply.usage.completion_tokens == 3
    text = httpx.get(f"{int8_server.url}/metrics").text
    kv = httpx.get(f"{int8_server.url}/v1/kv").json()
    assert "# TYPE cortexstream:kv_bytes_per_token gauge" in text
    assert f'cortexstream:kv_bytes_per_token{{model_name="tiny"}} {kv["bytes_per_token"]}' in text.splitlines()
    info = 'cortexstream:kv_cache_config_info{model_name="tiny",kv_dtype="int8",block_size="16"} 1'
    assert info in text.splitlines()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
@pytest.mark.parametrize("field, value", [("kv_dtype", "int4"), ("kv_dtype", "int8"), ("kv_group_size", 64)])
def test_a_request_cannot_choose_the_kv_storage(int8_server, path, body, field, value):
    response = httpx.post(f"{int8_server.url}{path}", json={"model": "tiny", "max_tokens": 2, **body, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    assert error["message"].startswith(f"{field}: the server's KV storage is fixed at startup (--kv-")
    assert int8_server.wait_idle()["sequences"] == []


def test_a_float_server_reports_its_model_dtype(tiny):
    with LiveServer(*tiny, kv_tokens=256) as live:
        kv = httpx.get(f"{live.url}/v1/kv").json()
        metrics = httpx.get(f"{live.url}/metrics").text
    assert kv["kv_dtype"] == "float32"
    assert kv["bytes_per_token"] == ArenaConfig.for_model(tiny[0], num_tokens=256).bytes_per_token
    assert 'kv_dtype="float32"' in metrics


# --- TUI ------------------------------------------------------------------------------------------------------------
def test_tui_config_takes_the_kv_options():
    from cortexstream.tui.config import TuiConfig

    config = TuiConfig.from_args(build_parser().parse_args(["tui", "--kv-dtype", "int4", "--kv-group-size", "32"]))
    assert (config.kv_dtype, config.kv_group_size) == ("int4", 32)


def test_tui_builds_its_engine_with_the_storage_and_shows_it(model32, tiny):
    from rich.console import Console

    from cortexstream.tui.app import CortexStreamApp
    from cortexstream.tui.config import TuiConfig
    from cortexstream.tui.widgets.stats import StatsPanel, kv_storage_text

    config = TuiConfig(kv_tokens=512, kv_dtype="int8", kv_group_size=32, deterministic=True)
    app = CortexStreamApp(config, model=model32, tokenizer=tiny[1])
    expected = ArenaConfig.for_model(model32, num_tokens=512, kv_dtype="int8", kv_group_size=32).bytes_per_token

    async def scenario() -> str:
        async with app.run_test(size=(120, 36)) as pilot:
            for _ in range(1500):
                if app.engine_link is not None and app.last_snapshot is not None:
                    break
                await pilot.pause(0.02)
            assert app.last_snapshot is not None, "the engine did not start"
            await pilot.pause()
            console = Console(width=80, record=True, file=io.StringIO())
            console.print(app.query_one(StatsPanel).content)
            return console.export_text()

    shown = asyncio.run(scenario())
    stats = app.last_snapshot.stats
    assert (stats["kv_dtype"], stats["bytes_per_token"]) == ("int8", expected)
    assert kv_storage_text(stats) == f"int8, {expected:,} B/token"
    assert "KV store" in shown and kv_storage_text(stats) in shown

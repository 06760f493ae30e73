"""Public entry points check their arguments at the door (InvalidArgumentError naming the argument), text with
undecodable bytes is repaired, and nothing waits forever on an engine that is not running (issue #24)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import cortexstream
from cortexstream.engine.threaded import ThreadedEngine
from cortexstream.errors import EngineNotRunningError, InvalidArgumentError, ModelLoadError
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.text_input import repair_messages, repair_text


def cli(*args: str, stdin: bytes | None = None, argv_bytes: list[bytes] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable.encode(), b"-m", b"cortexstream.cli.main", *[a.encode() for a in args], *(argv_bytes or [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CORTEXSTREAM_NO_OPENBLAS": "1"}
    return subprocess.run(command, capture_output=True, input=stdin, timeout=300, env=env)


# --- text input ------------------------------------------------------------------------------------------------

def test_repair_text_replaces_escaped_bytes_and_lone_surrogates_only():
    assert repair_text("plain é text") == "plain é text"
    escaped = b"a\xff\xfeb".decode("utf-8", "surrogateescape")  # what argv / input() give for such bytes
    assert repair_text(escaped) == "a\ufffd\ufffdb"
    assert repair_text("x\ud800y") == "x\ufffdy"
    assert repair_messages([{"role": "user", "content": escaped}])[0]["content"] == "a\ufffd\ufffdb"
    with pytest.raises(InvalidArgumentError, match="content must be a string"):
        repair_messages([{"role": "user", "content": 5}])


def test_undecodable_prompt_generates_instead_of_a_tokenizer_type_error(tiny):
    model, tokenizer = tiny
    prompt = b"\xff\xfe hi".decode("utf-8", "surrogateescape")
    text = cortexstream.generate(model, tokenizer, prompt, max_tokens=2)
    assert isinstance(text, str)


def test_cli_generate_with_undecodable_argv_runs(tiny_gguf):
    result = cli("generate", "--model", tiny_gguf, "--max-tokens", "2", "-p", argv_bytes=[])
    assert result.returncode != 0  # -p needs a value: argparse's own usage error, sanity check of the helper
    result = cli("generate", "--model", tiny_gguf, "--max-tokens", "2", argv_bytes=[b"-p", b"\xff\xfe"])
    assert result.returncode == 0, result.stderr.decode(errors="replace")


def test_chat_reports_a_bad_line_and_goes_on(tiny_gguf):
    result = cli("chat", "--model", tiny_gguf, "--max-tokens", "3", stdin=b"\xff\xfe\nhello\n/quit\n")
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, stderr
    assert "undecodable bytes" in stderr and "Traceback" not in stderr
    assert result.stdout.decode(errors="replace").count(">> ") >= 3  # the session went on to the next prompts


# --- arguments at the door ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "7"])
def test_seed_is_checked(seed):
    with pytest.raises(InvalidArgumentError, match="seed"):
        SamplingParams(seed=seed)


def test_cli_negative_seed_is_a_one_line_error_before_loading():
    result = cli("generate", "--model", "/nonexistent.gguf", "--prompt", "hi", "--seed", "-1")
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "seed: -1 is invalid" in lines[0]


def test_batch_generate_refuses_a_bare_string(tiny):
    model, tokenizer = tiny
    with pytest.raises(InvalidArgumentError, match="prompts: expected a list of prompts, got str"):
        cortexstream.batch_generate(model, tokenizer, "hi")


@pytest.mark.parametrize("source", [123, 4.5, ["a.gguf"]])
def test_load_refuses_non_path_sources(source):
    with pytest.raises(InvalidArgumentError, match="source: expected a path"):
        cortexstream.load(source)


def test_load_accepts_path_objects(tiny_gguf):
    from pathlib import Path

    model, _ = cortexstream.load(Path(tiny_gguf))
    assert len(model.layers) == 2


def test_load_of_a_directory_with_a_lying_safetensors_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelLoadError, match="model.safetensors: malformed safetensors: header length"):
        cortexstream.load(str(tmp_path))


# --- nothing waits forever --------------------------------------------------------------------------------------

def _run_with_deadline(fn, seconds: float = 20.0):
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "call blocked"
    return box


def test_submit_without_start_fails_at_once(tiny):
    threaded = ThreadedEngine(cortexstream.Engine(*tiny, kv_tokens=256))
    box = _run_with_deadline(lambda: threaded.submit("hello", max_tokens=2))
    assert isinstance(box.get("error"), EngineNotRunningError) and "never started" in str(box["error"])
    box = _run_with_deadline(lambda: threaded.call(lambda e: 1))
    assert isinstance(box.get("error"), EngineNotRunningError)


def test_submit_after_stop_fails_at_once_and_stop_fails_open_streams(tiny):
    threaded = ThreadedEngine(cortexstream.Engine(*tiny, kv_tokens=256)).start()
    stream = threaded.submit("hello", max_tokens=400)
    threaded.stop()
    box = _run_with_deadline(lambda: list(stream))
    assert isinstance(box.get("error"), EngineNotRunningError) or box["value"][-1].finished
    box = _run_with_deadline(lambda: threaded.submit("hello", max_tokens=2))
    assert isinstance(box.get("error"), EngineNotRunningError) and "stopped" in str(box["error"])
    with pytest.raises(EngineNotRunningError, match="cannot be restarted"):
        threaded.start()


def test_a_waiter_is_released_when_the_thread_stops_after_queueing(tiny):
    threaded = ThreadedEngine(cortexstream.Engine(*tiny, kv_tokens=256)).start()
    gate = threading.Event()

    def slow(engine):
        gate.wait(5)
        return "first"

    first = threading.Thread(target=lambda: threaded.call(slow), daemon=True)
    first.start()
    waiter = {}
    second = threading.Thread(target=lambda: waiter.update(box=_run_with_deadline(lambda: threaded.call(lambda e: 2))),
                              daemon=True)
    second.start()
    threading.Timer(0.3, lambda: (threaded._stop.set(), gate.set())).start()
    second.join(30)
    assert not second.is_alive()
    result = waiter["box"]
    assert result.get("value") == 2 or isinstance(result.get("error"), EngineNotRunningError)
    threaded.stop()


# --- more doors (found by probing every public entry point with bad values) -----------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"kv_tokens": -1}, "num_tokens"), ({"kv_tokens": "x"}, "num_tokens"), ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"prefill_step_size": 0}, "prefill_step_size"),
])
def test_engine_arguments_are_invalid_argument_errors(tiny, kwargs, name):
    with pytest.raises(InvalidArgumentError, match=name):
        cortexstream.Engine(*tiny, **kwargs)


def test_engine_and_caches_refuse_a_non_model():
    with pytest.raises(InvalidArgumentError, match="model: expected an mlx-lm model"):
        cortexstream.Engine(None, None)


@pytest.mark.parametrize("kwargs, name", [({"foo": 1}, "foo: unknown generation argument"), ({"stop": 5}, "stop")])
def test_generation_keyword_arguments_are_checked(tiny, kwargs, name):
    with pytest.raises(InvalidArgumentError, match=name):
        cortexstream.generate(*tiny, "hi", max_tokens=2, **kwargs)


def test_bytes_prompt_is_refused_not_read_as_token_ids(tiny):
    with pytest.raises(InvalidArgumentError, match="prompt: got bytes"):
        cortexstream.generate(*tiny, b"hi", max_tokens=2)


def test_add_request_checks_sampling_type(tiny):
    with pytest.raises(InvalidArgumentError, match="sampling: expected a SamplingParams, got str"):
        cortexstream.Engine(*tiny, kv_tokens=256).add_request("hi", sampling="x")


def test_two_threads_on_one_engine_get_a_clear_error(tiny):
    from cortexstream.engine.single_thread import EngineBusyError

    engine = cortexstream.Engine(*tiny, kv_tokens=256)
    engine.add_request("hello", max_tokens=2)
    inside, release = threading.Event(), threading.Event()
    original = engine.scheduler.schedule

    def slow_schedule():
        inside.set()
        release.wait(10)
        return original()

    engine.scheduler.schedule = slow_schedule
    first = threading.Thread(target=engine.step, daemon=True)
    first.start()
    assert inside.wait(10)
    try:
        with pytest.raises(EngineBusyError, match="use ThreadedEngine|with ThreadedEngine"):
            engine.step()
        with pytest.raises(EngineBusyError):
            engine.add_request("x", max_tokens=1)
    finally:
        release.set()
        first.join(10)
    engine.scheduler.schedule = original
    while engine.has_unfinished:  # the engine still works from one thread afterwards
        engine.step()


def test_cli_never_prints_an_empty_error(monkeypatch, capsys):
    from cortexstream.cli import commands
    from cortexstream.cli.main import main

    def out_of_memory(args):
        raise MemoryError()

    monkeypatch.setattr(commands, "run_info", out_of_memory)
    assert main(["info"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "cortexstream: error: MemoryError: out of memory: the request needs more than this machine can allocate"


def test_an_engine_arena_that_cannot_fit_in_memory_is_refused_with_the_numbers(tiny):
    with pytest.raises(InvalidArgumentError, match=r"num_tokens \(the arena's kv_tokens\): 1000000000000 tokens need "
                                                   r".* GiB of KV arena \(512 bytes per token\)"):
        cortexstream.Engine(*tiny, kv_tokens=10**12)


def test_model_directory_config_must_match_its_weights(tmp_path):
    import json

    import mlx.core as mx

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 9895938}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {"model.layers.0.mlp.up_proj.weight": mx.zeros((2, 2)),
                         "model.layers.1.mlp.up_proj.weight": mx.zeros((2, 2))})
    with pytest.raises(ModelLoadError, match=r"config.json: 'num_hidden_layers' is 9895938, the weights hold 2 layers"):
        cortexstream.load(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ModelLoadError, match=r"config.json: model config is unreadable or torn"):
        cortexstream.load(str(tmp_path))

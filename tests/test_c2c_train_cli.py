"""`cortexstream train c2c`: registered under `train`, argument errors name the flag, a run on tiny models writes
checkpoints and a held-out report, and a second run resumes instead of retraining."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from cortexstream.c2c.porting import load_fuser
from cortexstream.training.c2c.cli import add_arguments, execute
from cortexstream.errors import InvalidArgumentError
from tiny_models import tiny_model

TEXT = ("The river runs past the old mill and the miller counts the sacks of grain every morning. " * 40)


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_train_c2c_is_a_train_subcommand():
    from cortexstream.cli.main import build_parser

    args = build_parser().parse_args(["train", "c2c", "--steps", "3", "--sharer", "same"])
    assert args.train_kind == "c2c" and args.steps == 3


@pytest.mark.parametrize("argv, flag", [(["--bridge", "1"], "--bridge"), (["--steps", "0"], "--steps"),
                                        (["--export", "x.bin"], "--export"), (["--proj-layers", "2"], "--proj-layers")])
def test_bad_arguments_name_the_flag(tiny, argv, flag):
    model, tokenizer = tiny
    with pytest.raises(InvalidArgumentError, match=flag):
        execute(parse(*argv), (model, tokenizer, model, tokenizer, "same"))


def _run(tmp_path, tokenizer, sharer, steps=4, **extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "text.txt"
    source.write_text(TEXT, encoding="utf-8")
    argv = ["--out", str(tmp_path / "run"), "--source", str(source), "--skip", "0", "--context", "8",
            "--bridge", "4", "--target", "4", "--train-windows", "6", "--eval-windows", "2", "--steps", str(steps),
            "--batch-size", "2", "--checkpoint-every", "2", "--hidden-dim", "16", "--intermediate-dim", "16",
            "--rank", "4", "--no-progress"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    receiver = tiny_model(31)
    return execute(parse(*argv), (receiver, tokenizer, sharer or receiver, tokenizer, "test")), tmp_path / "run"


def test_a_run_writes_checkpoints_and_a_heldout_report_then_resumes(tiny, tmp_path):
    _, tokenizer = tiny
    report, out = _run(tmp_path, tokenizer, None, export=str(tmp_path / "f.safetensors"))
    for name in ("fuser.safetensors", "optimizer.safetensors", "state.json", "heldout.json",
                 "train_examples.safetensors", "eval_examples.safetensors"):
        assert (out / name).exists(), name
    assert report["fuser"] == "C2CFuser" and report["steps"] == 4
    assert report["data"]["train_tokens"] == [0, 96] and report["data"]["eval_tokens"] == [96, 128]
    assert set(report["trained"]) == {"kl", "ppl", "mse", "cos"}
    saved = json.loads((out / "heldout.json").read_text())
    assert saved["trained"] == report["trained"]
    assert load_fuser(str(tmp_path / "f.safetensors")).rank == 4
    again, _ = _run(tmp_path, tokenizer, None)  # same settings: nothing left to train, same weights
    assert again["history"] == report["history"] and again["trained"] == report["trained"]


def test_a_different_sharer_shape_gets_the_projector(tiny, tmp_path):
    _, tokenizer = tiny
    sharer = tiny_model(32, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, num_attention_heads=2)
    report, out = _run(tmp_path, tokenizer, sharer, steps=2)
    assert report["fuser"] == "C2CProjectorFuser"
    assert os.path.exists(out / "fuser.safetensors")
    with pytest.raises(InvalidArgumentError, match="--fuser lowrank"):
        _run(tmp_path / "x", tokenizer, sharer, steps=2, fuser="lowrank")

"""`cortexstream train sidecar` end to end on the tiny GGUF: collect, train, resume, held-out report, export, and
the exported weights used by the Sidecar policy; bad arguments give one clear line."""

from __future__ import annotations

import json
import os

import numpy as np

from cortexstream.cli.main import main
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.policies.sidecar import Sidecar
from cortexstream.sidecar.porting import read_sidecar_info
from tiny_models import random_token_ids

TEXT = " ".join(f"Sentence {i} tells of rivers, hills and the towns that grew beside them." for i in range(60))


def _args(tiny_gguf: str, out: str, text: str, export: str, steps: int = 4) -> list[str]:
    return ["train", "sidecar", "--model", tiny_gguf, "--source", text, "--skip", "100", "--seq-len", "64",
            "--sequences", "2", "--eval-sequences", "1", "--window", "4", "--queries", "4", "--steps", str(steps),
            "--batch-size", "16", "--d-model", "16", "--encoder-layers", "1", "--num-heads", "2",
            "--checkpoint-every", "2", "--eval-rows", "32", "--out", out, "--export", export, "--no-progress"]


def test_train_resume_export_and_use(tiny_gguf, tiny, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    out, export = str(tmp_path / "run"), str(tmp_path / "tiny_w4.safetensors")
    assert main(_args(tiny_gguf, out, str(text), export)) == 0
    first = capsys.readouterr().out
    assert "trajectories:" in first and "held-out sidecar" in first and "mean_pool_logN" in first
    index = json.load(open(os.path.join(out, "trajectories", "index.json"), encoding="utf-8"))
    assert index["sequences"] == 2 and "tokens [100, 228)" in index["data"] and "corpus.txt" in index["data"]
    held = json.load(open(os.path.join(out, "eval_trajectories", "index.json"), encoding="utf-8"))
    assert "tokens [228, 292)" in held["data"]  # right after the training text, disjoint from it
    report = json.load(open(os.path.join(out, "heldout.json"), encoding="utf-8"))
    assert report["step"] == 4 and set(report["heldout"]) == {"sidecar", "mean_pool_logN", "mean_pool_no_mass"}
    assert all(0 < v["force"] < 10 and v["rows"] == 32 for v in report["heldout"].values())
    # rerun: trajectories reused, training already at its last step
    assert main(_args(tiny_gguf, out, str(text), export)) == 0
    assert "reusing" in capsys.readouterr().out
    # other training text under the same checkpoint: refused instead of resuming on rows it never saw
    other = _args(tiny_gguf, out, str(text), export)
    other[other.index("--sequences") + 1] = "3"
    assert main(other) == 1 and "--no-resume" in capsys.readouterr().err
    info = read_sidecar_info(export)
    assert info["config"]["window"] == 4 and info["step"] == 4 and "heldout" in info and "train_data" in info
    # the exported file drives the policy
    nll = token_nlls(tiny[0], random_token_ids(60), Sidecar(window=4, sinks=2, recent=8, weights=export),
                     chunk_size=8)
    assert np.isfinite(nll).all()


def test_bad_arguments(tiny_gguf, tmp_path, capsys):
    missing, export = str(tmp_path / "missing.txt"), str(tmp_path / "x.safetensors")
    assert main(_args(tiny_gguf, str(tmp_path / "r"), missing, export)) == 1
    assert "--source" in capsys.readouterr().err
    assert main(["train", "sidecar", "--window", "1", "--out", str(tmp_path / "r")]) == 1
    assert "--window" in capsys.readouterr().err
    assert main(["train", "sidecar", "--export", "w.bin", "--out", str(tmp_path / "r")]) == 1
    assert "--export" in capsys.readouterr().err

"""`cortexstream train sidecar`: collect trajectories (once), train the sidecar (resumable), score it held out.

Layout of `--out DIR`:

    trajectories/        training rows (`sidecar.trajectories`; reused when complete with the same settings)
    eval_trajectories/   held-out rows from the text right after the training sequences
    sidecar.safetensors, optimizer.safetensors, state.json   checkpoints (`sidecar.train`; rerun to resume)
    heldout.json         exact force/consistency losses vs mean pooling on the held-out rows

`--export FILE` also writes the final network with its metadata (model shape, data source, held-out losses), the
form shipped in `cortexstream/sidecar/weights/`. Text comes from tokens `--skip` on of the source, disjoint from
what `bench quality` evaluates (see `cortexstream.training.text`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import Any

from cortexstream.atomic_files import read_json_file, write_json_atomic
from cortexstream.errors import InvalidArgumentError
from cortexstream.training.flags import TrainerDefaults, add_trainer_flags, check_trainer_flags, loop_config_kwargs

DEFAULTS = TrainerDefaults(steps=1000, batch_size=128, learning_rate=1e-3, weight_decay=0.01, warmup_cap=100,
                           checkpoint_every=100)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sidecar", help="force-matched sidecar: collect trajectories, train, evaluate")
    p.add_argument("--out", default=None, help="run folder (default: runs/sidecar_w<window>)")
    p.add_argument("--model", default=None, help="GGUF file or model directory (default: smollm2-135m)")
    p.add_argument("--window", type=int, default=16, help="tokens per bead")
    p.add_argument("--source", default="wiki", help="'wiki' (gensim Wikipedia), 'pydoc' or a text file")
    p.add_argument("--skip", type=int, default=None, help="source tokens to skip (default 65536: held out)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per collected sequence")
    p.add_argument("--sequences", type=int, default=16, help="training sequences")
    p.add_argument("--eval-sequences", type=int, default=1, help="held-out sequences after the training ones")
    p.add_argument("--queries", type=int, default=8, help="future queries stored per window")
    p.add_argument("--rows-per-chunk", type=int, default=4096)
    p.add_argument("--probes", type=int, default=8, help="Hutchinson probes per query (0: exact Jacobians)")
    p.add_argument("--lam", type=float, default=1.0, help="weight of the consistency term")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--encoder-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--no-log-mass", action="store_true", help="beads without a logit bias (not recommended)")
    p.add_argument("--eval-rows", type=int, default=1024)
    p.add_argument("--export", default=None, help="also write the final weights with metadata to this file")
    add_trainer_flags(p, DEFAULTS)


def _check(args: argparse.Namespace) -> None:
    check_trainer_flags(args)
    for name in ("window", "seq_len", "sequences", "eval_sequences", "queries", "rows_per_chunk", "d_model",
                 "encoder_layers", "num_heads", "eval_rows"):
        value = getattr(args, name)
        if value < (0 if name == "eval_sequences" else 1):
            raise InvalidArgumentError(f"--{name.replace('_', '-')}: {value} must be positive")
    if args.window < 2 or args.seq_len <= args.window + 4:
        raise InvalidArgumentError(f"--window {args.window} must be >= 2 and --seq-len {args.seq_len} > window + 4")
    if args.probes < 0:
        raise InvalidArgumentError(f"--probes: {args.probes} must be >= 0 (0: exact)")
    if args.export and not args.export.endswith(".safetensors"):
        raise InvalidArgumentError(f"--export: '{args.export}' must end in .safetensors")


def _complete(directory: str, collect: dict[str, Any], sequences: int, data: str) -> bool:
    """A finished collection with the same settings and text (collection itself is not resumable)."""
    path = os.path.join(directory, "index.json")
    if not os.path.exists(path):
        return False
    index = read_json_file(path, "trajectory index")
    if not isinstance(index, dict):
        return False
    return (index.get("collect") == collect and index.get("sequences") == sequences and index.get("data") == data
            and "peak_buffered_rows" in index)


def _collect(model: Any, seqs: list[list[int]], directory: str, config: Any, data: str, progress: bool) -> bool:
    """Collect unless a complete, identical collection is there. Returns True if it collected."""
    import shutil

    from cortexstream.training.sidecar.trajectories import collect_trajectories

    collect = {**asdict(config), "layers": config.layers}
    if _complete(directory, json.loads(json.dumps(collect)), len(seqs), data):
        print(f"trajectories: reusing {directory}")
        return False
    if os.path.exists(directory):
        shutil.rmtree(directory)  # partial or different collection: start it over
    index = collect_trajectories(model, seqs, directory, config, progress=progress, total=len(seqs))
    index = read_json_file(os.path.join(directory, "index.json"), "trajectory index")
    index["data"] = data
    write_json_atomic(os.path.join(directory, "index.json"), index, indent=1)
    print(f"trajectories: {index['rows']} rows in {len(index['chunks'])} chunks -> {directory}")
    return True


def run(args: argparse.Namespace) -> int:
    _check(args)
    from cortexstream.models.loader import load
    from cortexstream.training.text import DEFAULT_SKIP, token_sequences
    from cortexstream.training.sidecar.heldout import export_weights, heldout_losses
    from cortexstream.training.sidecar.train import TrainConfig, train_sidecar
    from cortexstream.training.sidecar.trajectories import CollectConfig, TrajectoryStore

    out = args.out or os.path.join("runs", f"sidecar_w{args.window}")
    skip = DEFAULT_SKIP if args.skip is None else args.skip
    progress = not args.no_progress
    model, tokenizer = load(args.model)
    total = args.sequences + args.eval_sequences
    seqs, description, source_tokens = token_sequences(tokenizer, args.source, skip=skip, sequence_length=args.seq_len,
                                                       count=total)
    split = skip + args.sequences * args.seq_len
    train_data = f"{description}: tokens [{skip}, {split}) of {source_tokens}"
    eval_data = f"{description}: tokens [{split}, {skip + total * args.seq_len}) of {source_tokens}"
    collect = CollectConfig(window=args.window, queries_per_window=args.queries, rows_per_chunk=args.rows_per_chunk,
                            seed=args.seed)
    traj_dir, eval_dir = os.path.join(out, "trajectories"), os.path.join(out, "eval_trajectories")
    fresh = _collect(model, seqs[:args.sequences], traj_dir, collect, train_data, progress)
    if fresh and args.resume and os.path.exists(os.path.join(out, "state.json")):
        # resuming would continue a run on rows it never trained on (its data order would silently change)
        raise InvalidArgumentError(f"--out {out}: holds a checkpoint trained on other trajectories; "
                                   "use --no-resume or another --out")
    if args.eval_sequences:
        _collect(model, seqs[args.sequences:], eval_dir, CollectConfig(**{**asdict(collect), "seed": args.seed + 1}),
                 eval_data, progress)
    config = TrainConfig(**loop_config_kwargs(args), lam=args.lam, probes=args.probes or None)
    network = {"d_model": args.d_model, "encoder_layers": args.encoder_layers, "num_heads": args.num_heads,
               "log_mass": not args.no_log_mass}
    net, state = train_sidecar(traj_dir, out, network=network, config=config, resume=args.resume,
                               progress=progress, stop_at=args.stop_at)
    last = state["history"][-1] if state["history"] else None
    if last:
        print(f"trained to step {state['step']}: loss {last[1]:.4f} (force {last[2]:.4f}, consistency {last[3]:.4f})")
    report: dict[str, Any] = {"train_data": train_data, "step": state["step"]}
    if args.eval_sequences:
        report["eval_data"] = eval_data
        report["heldout"] = heldout_losses(net, TrajectoryStore(eval_dir), rows=args.eval_rows, lam=args.lam)
        for name, losses in report["heldout"].items():
            print(f"held-out {name:18s} force {losses['force']:.4f}  consistency {losses['consistency']:.4f}  "
                  f"({losses['rows']} rows, exact)")
    write_json_atomic(os.path.join(out, "heldout.json"), report, indent=1)
    if args.export:
        from cortexstream.models.loader import model_info

        info = model_info(model)
        export_weights(os.path.join(out, "sidecar.safetensors"), args.export, {
            "model": args.model or "smollm2-135m", "model_info": repr(info) if info is not None else None,
            **report})
        print(f"exported -> {args.export}")
    return 0

"""`cortexstream train merger`: train the merger of evicted tokens (the compressor's MLPs folding what H2O drops
into the kept token it resembles) for the loaded model, then export it.

Data: segments of `wiki_text()` from --train-offset (held-out at --val-offset), never the first 20k tokens that
`bench quality` scores. Outputs in --out: `merger.safetensors` (float32), `optimizer.safetensors`, `state.json`
(KLs of H2O, D2O and the merger); --export adds a float16 copy, which `merger:weights=PATH` loads.
"""

from __future__ import annotations

import argparse
import json
import os

from cortexstream.errors import InvalidArgumentError
from cortexstream.training.flags import (TrainerDefaults, add_teacher_data_flags, add_trainer_flags,
                                         check_trainer_flags, loop_config_kwargs)

_TRAIN_ARGS = ("network", "budget", "threshold", "sinks", "prefix", "queries", "max_offset")
DEFAULTS = TrainerDefaults(steps=300, batch_size=4, learning_rate=3e-4, warmup=10, checkpoint_every=50,
                           resume=False)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("merger", help="train the merger of evicted tokens (folds what H2O drops)")
    p.add_argument("--model", default=None, help="GGUF file, model directory or hub repo id (default: smollm2-135m)")
    p.add_argument("--out", required=True, help="run directory (checkpoints, state.json)")
    p.add_argument("--network", default="compressor", choices=["compressor", "sidecar"],
                   help="the compressor's MLPs (a residual on the kept token) or the sidecar's set encoder")
    p.add_argument("--budget", type=float, default=0.2, help="H2O's share of each training prefix")
    p.add_argument("--threshold", type=float, default=0.5, help="cosine a dropped token needs to join a group")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--prefix", type=int, default=512, help="prefix tokens per segment (H2O keeps --budget of them)")
    p.add_argument("--queries", type=int, default=32, help="scored tokens after the prefix")
    add_teacher_data_flags(p)
    p.add_argument("--pool-cache", default=None,
                   help="folder to store/reuse teacher pools and H2O scores (shared by runs on the same data)")
    p.add_argument("--export", default=None,
                   help="also write the weights to PATH (.safetensors; a compressor's in float16)")
    add_trainer_flags(p, DEFAULTS)


def run(args: argparse.Namespace) -> int:
    import cortexstream
    from cortexstream.training.compression.data import wiki_segments
    from cortexstream.compression.evicted_merger import save_merger
    from cortexstream.training.merger.train import MergerTrainConfig, metadata, train_merger

    check_trainer_flags(args)
    config = MergerTrainConfig(**loop_config_kwargs(args),
                               **{k: v for k, v in vars(args).items() if k in _TRAIN_ARGS})
    if args.export is not None and not args.export.endswith(".safetensors"):
        raise InvalidArgumentError(f"--export {args.export}: must be a .safetensors file")
    if os.path.exists(os.path.join(args.out, "state.json")) and not args.resume:
        raise InvalidArgumentError(f"--out {args.out}: holds a run already; pass --resume or another --out")
    model, tokenizer = cortexstream.load(args.model)
    train, val = wiki_segments(tokenizer, train_offset=args.train_offset, val_offset=args.val_offset,
                               train=args.segments, val=max(args.val_segments, 1),
                               length=config.prefix + config.queries)
    merger, state = train_merger(model, train, args.out, config, val=val if args.val_segments else None,
                                 resume=args.resume, progress=not args.no_progress, stop_at=args.stop_at,
                                 model_name=args.model or "smollm2-135m", pool_cache=args.pool_cache)
    if args.export:
        save_merger(merger, args.export, metadata(state), dtype="float16")
    print(json.dumps({"step": state["step"], "baselines": state["baselines"], "first_eval": state["evals"][0],
                      "last_eval": state["evals"][-1], "final": state.get("final")}, indent=1))
    return 0

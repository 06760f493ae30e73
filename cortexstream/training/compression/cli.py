"""`cortexstream train compressor`: train a FastCache-style KV compressor for the loaded model, then export it.

Data: segments of `wiki_text()` starting at token --train-offset (validation at --val-offset), never the first 20k
tokens that `bench quality` scores. Outputs in --out: `compressor.safetensors` (the checkpoint, float32),
`optimizer.safetensors`, `state.json` (losses, baselines, data ranges); --export adds copies as `.safetensors`
(float16 by default), `.pth` (torch.save format, written without torch) or `.bin` (InfiniLM), by extension.
"""

from __future__ import annotations

import argparse
import json
import os

from cortexstream.errors import InvalidArgumentError
from cortexstream.training.flags import (TrainerDefaults, add_teacher_data_flags, add_trainer_flags,
                                         check_trainer_flags, loop_config_kwargs)

# argparse dests that are TrainConfig fields beside the shared loop flags (the rest choose data, outputs, model)
_TRAIN_ARGS = ("factor", "prefix", "queries", "sinks", "recent", "mse_weight", "log_mass_bias", "dropout",
               "max_offset", "init")
# A compressor run refuses a used --out unless --resume is given (see `cortexstream.training.flags`).
DEFAULTS = TrainerDefaults(steps=100, batch_size=4, learning_rate=3e-6, warmup=5, checkpoint_every=20,
                           resume=False)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compressor", help="train a learned KV compressor (FastCache style) on real text")
    p.add_argument("--model", default=None, help="GGUF file, model directory or hub repo id (default: smollm2-135m)")
    p.add_argument("--out", required=True, help="run directory (checkpoints, state.json)")
    p.add_argument("--factor", type=int, default=4, help="tokens merged into one slot")
    p.add_argument("--prefix", type=int, default=256, help="prefix tokens per segment (older part compressed)")
    p.add_argument("--queries", type=int, default=32, help="scored tokens after the prefix")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=16, help="raw tokens before the queries while training")
    p.add_argument("--mse-weight", type=float, default=0.0, help="weight of the hidden-state MSE term")
    p.add_argument("--log-mass-bias", action="store_true",
                   help="train with log(factor) added to merged slots' attention logits (not in the reference)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--init", default="meanpool", choices=["random", "meanpool"],
                   help="initial weights: random (the reference) or exactly mean pooling")
    add_teacher_data_flags(p)
    p.add_argument("--export", action="append", default=[],
                   help="also write the trained weights to PATH (.safetensors, .pth or .bin; repeatable)")
    p.add_argument("--export-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--pool-cache", default=None,
                   help="folder to store/reuse teacher pools (shared by runs of other factors on the same data)")
    add_trainer_flags(p, DEFAULTS)


def export(compressor: object, path: str, dtype: str = "float16", metadata: dict[str, str] | None = None) -> None:
    """Write trained weights by extension: .safetensors (with metadata), .pth/.pt (torch.save zip), .bin."""
    from cortexstream.port.torch_save import save_torch

    ext = os.path.splitext(path)[1].lower()
    if ext == ".safetensors":
        compressor.save(path, dtype=dtype, metadata=metadata)  # type: ignore[attr-defined]
    elif ext in (".pth", ".pt"):
        import mlx.core as mx

        dt = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
        save_torch(path, {k: v.astype(dt) for k, v in compressor.state_dict().items()})  # type: ignore[attr-defined]
    elif ext == ".bin":
        compressor.save_infinilm_bin(path, dtype="float32" if dtype == "float32" else "float16")  # type: ignore
    else:
        raise InvalidArgumentError(f"--export {path}: unknown extension '{ext}' (.safetensors, .pth, .pt or .bin)")


def run(args: argparse.Namespace) -> int:
    import cortexstream
    from cortexstream.training.compression.data import wiki_segments
    from cortexstream.training.compression.train import TrainConfig, checkpoint_metadata, train_compressor

    check_trainer_flags(args)
    config = TrainConfig(**loop_config_kwargs(args), **{k: v for k, v in vars(args).items() if k in _TRAIN_ARGS})
    for path in args.export:  # fail before hours of training, not after
        if os.path.splitext(path)[1].lower() not in (".safetensors", ".pth", ".pt", ".bin"):
            raise InvalidArgumentError(f"--export {path}: unknown extension (.safetensors, .pth, .pt or .bin)")
    state_path = os.path.join(args.out, "state.json")
    if os.path.exists(state_path) and not args.resume:
        raise InvalidArgumentError(f"--out {args.out}: holds a run already; pass --resume or another --out")
    model, tokenizer = cortexstream.load(args.model)
    length = config.prefix + config.queries
    train, val = wiki_segments(tokenizer, train_offset=args.train_offset, val_offset=args.val_offset,
                               train=args.segments, val=max(args.val_segments, 1), length=length)
    name = args.model or "smollm2-135m"
    comp, state = train_compressor(model, train, args.out, config, val=val if args.val_segments else None,
                                   resume=args.resume, progress=not args.no_progress, stop_at=args.stop_at,
                                   model_name=name, pool_cache=args.pool_cache)
    for path in args.export:
        export(comp, path, args.export_dtype, checkpoint_metadata(state))
    summary = {"step": state["step"], "baselines": state["baselines"], "first_eval": state["evals"][0],
               "last_eval": state["evals"][-1], "final": state.get("final"),
               "last_train_kl": state["history"][-1][2] if state["history"] else None}
    print(json.dumps(summary, indent=1))
    return 0

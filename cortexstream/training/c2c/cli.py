"""`cortexstream train c2c`: build held-out example sets (once), train a fuser (resumable), score it held out.

Layout of `--out DIR`:

    train_examples.safetensors, eval_examples.safetensors   example sets (`c2c.data`; reused when identical)
    fuser.safetensors, optimizer.safetensors, state.json    checkpoints (`c2c.train`; rerun to resume)
    heldout.json    KL to the full-context oracle and continuation perplexity: no fusion, the fuser before
                    training, after training, and the oracle itself

Sharer: `same` (default; the receiver's own cache of the full context, a donor session of the same model),
`qwen2.5-coder-0.5b` (fetched and verified from a checkout by `python -m bench.assets`; see `sharer_asset`), or any
model path `cortexstream.load` accepts. Fuser: `lowrank` (the seed's; same KV shapes only) or `projector`
(the paper's). Text comes from tokens `--skip` on, disjoint from what `bench quality` evaluates (`c2c.data`).
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from cortexstream.atomic_files import write_json_atomic
from cortexstream.errors import InvalidArgumentError
from cortexstream.training.flags import TrainerDefaults, add_trainer_flags, check_trainer_flags, loop_config_kwargs

QWEN = "qwen2.5-coder-0.5b"
DEFAULTS = TrainerDefaults(steps=150, batch_size=4, learning_rate=1e-3, checkpoint_every=25, warmup_cap=10)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("c2c", help="C2C cache fuser: distil to the full-context receiver, held-out eval")
    add_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="run folder (default: runs/c2c_<sharer>_<fuser>)")
    p.add_argument("--receiver", default=None, help="receiver model (default: smollm2-135m)")
    p.add_argument("--sharer", default="same", help=f"'same', '{QWEN}' (fetched asset) or a model path")
    p.add_argument("--fuser", choices=("auto", "lowrank", "projector"), default="auto",
                   help="auto: lowrank when the KV shapes match, else projector")
    p.add_argument("--rank", type=int, default=32, help="lowrank: projector rank")
    p.add_argument("--gate-init", type=float, default=-3.0, help="lowrank: initial gate logit (seed: 0)")
    p.add_argument("--hidden-dim", type=int, default=128, help="projector: hidden width")
    p.add_argument("--intermediate-dim", type=int, default=256, help="projector: FFN width")
    p.add_argument("--proj-layers", type=int, default=3, help="projector: num_layers (>= 3)")
    p.add_argument("--dropout", type=float, default=0.0, help="projector: dropout")
    p.add_argument("--no-zero-init", action="store_true",
                   help="projector: random output layers (reference default); by default they start at zero, so a "
                        "gate that opens early adds nothing until the projection has learnt something")
    p.add_argument("--source", default="wiki", help="'wiki', 'pydoc' or a text file")
    p.add_argument("--skip", type=int, default=None, help="source tokens to skip (default 65536: held out)")
    p.add_argument("--context", type=int, default=96, help="tokens only the sharer reads")
    p.add_argument("--bridge", type=int, default=32, help="tokens both read (fused)")
    p.add_argument("--target", type=int, default=32, help="continuation tokens scored")
    p.add_argument("--train-windows", type=int, default=64)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows after the training ones")
    p.add_argument("--align-weight", type=float, default=0.1, help="weight of hidden-state alignment")
    p.add_argument("--align", choices=("mse", "cos"), default="mse")
    p.add_argument("--export", default=None, help="also copy the trained fuser to this .safetensors file")
    add_trainer_flags(p, DEFAULTS)


def _check(args: argparse.Namespace) -> None:
    check_trainer_flags(args)
    for name in ("rank", "hidden_dim", "intermediate_dim", "context", "bridge", "target", "train_windows",
                 "eval_windows"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.bridge < 2:
        raise InvalidArgumentError(f"--bridge: {args.bridge} must be >= 2 (the last bridge token is not fused)")
    if args.proj_layers < 3:
        raise InvalidArgumentError(f"--proj-layers: {args.proj_layers} must be >= 3")
    if args.export and not args.export.endswith(".safetensors"):
        raise InvalidArgumentError(f"--export: '{args.export}' must end in .safetensors")


def load_sharer(name: str, receiver: Any, tokenizer: Any) -> tuple[Any, Any, str]:
    """(model, tokenizer, description) of the sharer."""
    import cortexstream

    if name == "same":
        return receiver, tokenizer, "same model (the receiver's own cache of the full context)"
    path = name
    if name == QWEN:
        from cortexstream.training.c2c.sharer_asset import qwen_coder_gguf

        path = qwen_coder_gguf()
    model, tok = cortexstream.load(path)
    return model, tok, path


def make_fuser(args: argparse.Namespace, receiver: Any, sharer: Any) -> Any:
    from cortexstream.c2c import C2CFuser, C2CProjectorFuser
    from cortexstream.kv.arena_config import model_kv_shape

    tl, th, td, _ = model_kv_shape(receiver)
    _, sh, sd, _ = model_kv_shape(sharer)
    kind = args.fuser if args.fuser != "auto" else ("lowrank" if (sh, sd) == (th, td) else "projector")
    if kind == "lowrank":
        if (sh, sd) != (th, td):
            raise InvalidArgumentError(f"--fuser lowrank: sharer KV {sh}x{sd} != receiver {th}x{td}; use projector")
        return C2CFuser(n_layers=tl, head_dim=td, rank=args.rank, gate_init=args.gate_init)
    return C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=args.hidden_dim,
                                         intermediate_dim=args.intermediate_dim, num_layers=args.proj_layers,
                                         dropout=args.dropout, zero_init=not args.no_zero_init)


def execute(args: argparse.Namespace, models: tuple[Any, Any, Any, Any, str] | None = None,
            controls: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole run; `models` = (receiver, tokenizer, sharer, sharer tokenizer, sharer description) to reuse
    loaded models; `controls` = name -> extra fuser scored on the held-out set (report["controls"]). Returns the
    held-out report (also written to `<out>/heldout.json`)."""
    _check(args)
    import mlx.core as mx

    from cortexstream.c2c.alignment import TokenAligner
    from cortexstream.training.c2c.data import DEFAULT_SKIP, example_set, windows
    from cortexstream.training.c2c.distill import Split
    from cortexstream.training.c2c.train import TrainConfig, evaluate, oracle_ppl, train_fuser

    if models is None:
        import cortexstream

        receiver, tokenizer = cortexstream.load(args.receiver)
        sharer, sharer_tok, sharer_desc = load_sharer(args.sharer, receiver, tokenizer)
    else:
        receiver, tokenizer, sharer, sharer_tok, sharer_desc = models
    mx.random.seed(args.seed)
    fuser = make_fuser(args, receiver, sharer)
    kind = type(fuser).__name__
    out = args.out or os.path.join("runs", f"c2c_{args.sharer.replace('/', '_')}_{kind}")
    split = Split(args.context, args.bridge, args.target)
    skip = DEFAULT_SKIP if args.skip is None else args.skip
    progress = not args.no_progress
    train_ids, eval_ids, info = windows(tokenizer, args.source, split, skip=skip, n_train=args.train_windows,
                                        n_eval=args.eval_windows)
    align = None if sharer is receiver else TokenAligner(tokenizer, sharer_tok).align
    base = {"receiver": args.receiver or "smollm2-135m", "sharer": sharer_desc, "source": info["source"]}
    train = example_set(os.path.join(out, "train_examples.safetensors"), receiver, sharer, train_ids, split,
                        {**base, "tokens": info["train_tokens"]}, align, progress)
    held = example_set(os.path.join(out, "eval_examples.safetensors"), receiver, sharer, eval_ids, split,
                       {**base, "tokens": info["eval_tokens"]}, align, progress)
    report: dict[str, Any] = {"data": info, "sharer": sharer_desc, "fuser": kind, "settings": vars(args).copy()}
    report["no_fusion"] = evaluate(None, receiver, held)
    report["untrained"] = evaluate(fuser, receiver, held)
    report["oracle_ppl"] = oracle_ppl(receiver, held)
    report["controls"] = {name: evaluate(extra, receiver, held) for name, extra in (controls or {}).items()}
    config = TrainConfig(**loop_config_kwargs(args), align_weight=args.align_weight, align=args.align)
    fuser, state = train_fuser(fuser, receiver, train, out, config=config, resume=args.resume, progress=progress,
                               stop_at=args.stop_at)
    report["trained"] = evaluate(fuser, receiver, held)
    report["train_fit"] = evaluate(fuser, receiver, train)
    report["train_no_fusion"] = evaluate(None, receiver, train)
    report["train_oracle_ppl"] = oracle_ppl(receiver, train)
    report["steps"] = state["step"]
    report["history"] = state["history"]
    write_json_atomic(os.path.join(out, "heldout.json"), report, indent=1)
    if args.export:
        shutil.copyfile(os.path.join(out, "fuser.safetensors"), args.export)
    return report


def run(args: argparse.Namespace) -> int:
    report = execute(args)
    print(f"held-out ({report['data']['eval_tokens']} of {report['data']['source']}), "
          f"KL to the full-context receiver (nats/token) and continuation perplexity:")
    for name in ("no_fusion", "untrained", "trained"):
        row = report[name]
        print(f"  {name:10s} KL {row['kl']:.4f}  ppl {row['ppl']:.2f}")
    print(f"  oracle     KL 0       ppl {report['oracle_ppl']:.2f}   ({report['steps']} steps, {report['fuser']})")
    return 0

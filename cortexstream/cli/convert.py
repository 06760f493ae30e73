"""`cortexstream convert SRC OUT_DIR`: any model `load` reads, written as an mlx-lm directory."""

from __future__ import annotations

import argparse


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser("convert", help="write a GGUF (or any loadable model) as an mlx-lm directory")
    convert.add_argument("source", help="GGUF file, model directory or 'smollm2-135m'")
    convert.add_argument("out_dir", help="output directory (config.json, model.safetensors, tokenizer files)")
    convert.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                         help="weight dtype (default: float32 on CPU; float16 rounds, so greedy tokens may differ)")
    convert.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")


def run_convert(args: argparse.Namespace) -> int:
    from cortexstream.models.export_mlx_lm import export_mlx_lm
    from cortexstream.models.loader import load

    model, tokenizer = load(args.source, dequantize=True, dtype=args.dtype)
    out = export_mlx_lm(model, tokenizer, args.out_dir, overwrite=args.overwrite)
    print(f"wrote {out} (open it with mlx_lm.load or mlx_lm.server --model {out})")
    return 0

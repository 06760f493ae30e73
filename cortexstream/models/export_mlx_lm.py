"""Write a loaded model as an mlx-lm directory: config.json, model.safetensors and the tokenizer files.

`mlx_lm.load(out_dir)` (and `mlx_lm.server --model out_dir`) then runs the very same weights as CortexStream:
the config is the model's own `ModelArgs` (for a llama-architecture GGUF that includes `rope_traditional: true`,
the interleaved RoPE that llama.cpp's Q/K permutation needs; mlx-lm's llama reads it from config.json), the
weights are written exactly as loaded (a quantised GGUF dequantised to float32 on CPU, so nothing is rounded
again), and the tokenizer is the one rebuilt from the GGUF with its chat template. The end-of-turn tokens the
GGUF tokenizer stops on go into config.json's `eos_token_id`, which mlx-lm's loader passes to its tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from cortexstream.errors import InvalidArgumentError


def model_config(model: nn.Module) -> dict[str, Any]:
    args = getattr(model, "args", None)
    if args is None or not dataclasses.is_dataclass(args):
        raise InvalidArgumentError("model: has no mlx-lm ModelArgs dataclass (`model.args`); cannot write config")
    config = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    config.setdefault("model_type", getattr(model, "model_type", None) or config.get("model_type"))
    return config


def export_mlx_lm(model: nn.Module, tokenizer: Any, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write `model` + `tokenizer` (mlx-lm `TokenizerWrapper`) as an mlx-lm model directory; returns its path."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InvalidArgumentError(f"out_dir: {out} exists and is not empty (pass overwrite=True / --overwrite)")
    if any(".scales" in name for name, _ in tree_flatten(model.parameters())):
        raise InvalidArgumentError("model: quantised weights cannot be exported; load it dequantised")
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(model)
    eos = sorted(int(i) for i in (getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]))
    config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    hf_tokenizer = tokenizer  # mlx-lm's TokenizerWrapper hands unknown attributes to the tokenizer it wraps
    hf_tokenizer.save_pretrained(str(out))
    template = getattr(hf_tokenizer, "chat_template", None)
    if template and not (out / "chat_template.jinja").exists():
        # Older transformers keep the template only in tokenizer_config.json; newer ones write this file.
        config_path = out / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text(encoding="utf-8"))
        tok_config.setdefault("chat_template", template)
        config_path.write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return out

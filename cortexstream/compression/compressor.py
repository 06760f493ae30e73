"""Learned KV compressor (FastCache style): merge every `factor` consecutive tokens into one with small MLPs.

Facts from the reference, Ringssss/Fastcache `utils_ccm/module_ccm.py`, class `KVCacheLinearDecoupleCompressor`
(arXiv 2503.08461):
- per layer four `nn.Sequential(Linear(D*f, D), ReLU, Dropout(0.4), Linear(D, D), ReLU, Dropout(0.4), Linear(D, D))`
  held in ModuleLists `compress_tk`, `compress_tv` (text K/V) and `compress_ik`, `compress_iv` (image K/V), so
  state-dict keys are `compress_tk.<layer>.<0|3|6>.<weight|bias>`; plus `attention.<layer>` = Linear(D, 1), which
  `forward` never uses (we drop it when porting);
- `compress_layer`: for [B, H, S, D], n = S // f; if n < min_seq_len the segment is returned unchanged; else
  `k[:, :, :n*f].reshape(B, H, n, D*f)` (f consecutive tokens side by side, token-major) goes through the MLP and
  the S - n*f remainder tokens are appended uncompressed after the n merged ones;
- `forward(kv_cache, it_len)`: the first it_len[0] tokens (image prefix) use the image MLPs, the rest the text MLPs,
  each segment compressed on its own; output = concat(image part, text part). Its default it_len=[1, 1] treats one
  token as image: we default image_len to 0 instead;
- head_dim = hidden_size // num_key_value_heads, which is wrong under GQA (SmolLM2-135M: 576 // 3 = 192, real 64);
  we take the real head_dim (`head_dim_of`).
InfiniTensor/InfiniLM `csrc/cache/kv_compression.cpp` (inference port) agrees, clamps the image length to the sequence
length and keeps the image prefix uncompressed when the file has no image MLPs (text-only export); we do the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.port import load_checkpoint, load_strict, map_state_dict, save_safetensors, write_infinilm_bin
from cortexstream.port.finite import check_finite

PREFIXES = ("compress_tk", "compress_tv", "compress_ik", "compress_iv")
_KEY = r"compress_(?:tk|tv|ik|iv)\.\d+\.\d+\.(?:weight|bias)"
# Reference checkpoints nest the compressor ("compressor.", "model_state_dict.compressor.", DataParallel's "module.").
FASTCACHE_RULES = ((rf"(?:.*\.)?({_KEY})", r"\1"),)
FASTCACHE_DROP = (r"(?:.*\.)?attention\.\d+\.(?:weight|bias)",)
FORMAT = "cortexstream.kv_compressor"
_LAYER = re.compile(r"compress_(?:tk|tv|ik|iv)\.(\d+)\..*")
_STORE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def map_fastcache_state_dict(state: Mapping[str, Any], source: str = "state dict") -> dict[str, Any]:
    """Reference (PyTorch) names -> ours: strip wrapper prefixes, drop the unused `attention` Linears (pure)."""
    return map_state_dict(state, FASTCACHE_RULES, drop=FASTCACHE_DROP, source=source)


@dataclass(frozen=True)
class CompressorConfig:
    """Shape of a compressor. head_dim is the model's real per-head dim (not hidden // kv_heads)."""

    num_layers: int
    head_dim: int
    factor: int
    min_seq_len: int = 1
    image: bool = True  # also hold compress_ik / compress_iv (the image-prefix MLPs)
    dropout: float = 0.4  # the reference's; only active after `.train()`

    def __post_init__(self) -> None:
        for name in ("num_layers", "head_dim", "factor"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.factor < 2:
            raise InvalidArgumentError(f"factor: must be >= 2 to compress anything, got {self.factor}")
        if not isinstance(self.min_seq_len, int) or self.min_seq_len < 0:
            raise InvalidArgumentError(f"min_seq_len: must be an integer >= 0, got {self.min_seq_len!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidArgumentError(f"dropout: must be in [0, 1), got {self.dropout}")


def head_dim_of(model: Any) -> int:
    """The real attention head dim of a loaded model (what the KV cache's last axis holds)."""
    info = getattr(model, "cortexstream_info", None)  # models.loader.model_info (foundation: no import)
    if info is not None and getattr(info, "head_dim", None):
        return int(info.head_dim)
    args = getattr(model, "args", None)
    if args is not None and getattr(args, "head_dim", None):
        return int(args.head_dim)
    if args is not None:
        return int(args.hidden_size) // int(args.num_attention_heads)
    raise InvalidArgumentError("model: cannot determine head_dim (no loader info and no .args)")


def segment_length(seq_len: int, factor: int, min_seq_len: int) -> int:
    """Tokens left after compressing one segment of `seq_len` tokens (n merged + remainder, or unchanged)."""
    n = seq_len // factor
    return seq_len if n == 0 or n < min_seq_len else n + seq_len - n * factor


def _mlp(head_dim: int, factor: int, dropout: float) -> list[nn.Module]:
    # A plain list mirrors torch's Sequential indices, so parameters flatten as '<i>.<0|3|6>.weight'.
    return [nn.Linear(head_dim * factor, head_dim), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(head_dim, head_dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(head_dim, head_dim)]


class KVCompressor(nn.Module):
    """Per-layer text (and optional image) K/V MLPs; `compress` shortens a layer's cache along the token axis.

    Created in eval mode (dropout off); call `.train()` for training and `.eval()` after.
    """

    def __init__(self, config: CompressorConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.compress_tk = [_mlp(c.head_dim, c.factor, c.dropout) for _ in range(c.num_layers)]
        self.compress_tv = [_mlp(c.head_dim, c.factor, c.dropout) for _ in range(c.num_layers)]
        if c.image:
            self.compress_ik = [_mlp(c.head_dim, c.factor, c.dropout) for _ in range(c.num_layers)]
            self.compress_iv = [_mlp(c.head_dim, c.factor, c.dropout) for _ in range(c.num_layers)]
        self.eval()

    @property
    def factor(self) -> int:
        return self.config.factor

    @property
    def min_seq_len(self) -> int:
        return self.config.min_seq_len

    def output_length(self, seq_len: int, image_len: int = 0) -> int:
        """Length `compress` returns for `seq_len` tokens whose first `image_len` are the image prefix."""
        img = min(max(image_len, 0), seq_len)
        c = self.config
        img_out = segment_length(img, c.factor, c.min_seq_len) if c.image else img
        return img_out + segment_length(seq_len - img, c.factor, c.min_seq_len)

    def _windows(self, x: mx.array, mlp: list[nn.Module]) -> mx.array:
        """The MLP on every window of `factor` consecutive tokens (token-major), S a multiple of factor."""
        seq, f, d = x.shape[-2], self.config.factor, x.shape[-1]
        h = x.reshape(*x.shape[:-2], seq // f, f * d).astype(mlp[0].weight.dtype)
        for layer in mlp:
            h = layer(h)
        return h.astype(x.dtype)

    def _segment(self, x: mx.array, mlp: list[nn.Module]) -> mx.array:
        seq, f = x.shape[-2], self.config.factor
        n = seq // f
        if n == 0 or n < self.config.min_seq_len:
            return x
        h = self._windows(x[..., : n * f, :], mlp)
        return h if n * f == seq else mx.concatenate([h, x[..., n * f:, :]], axis=-2)

    def merge_windows(self, keys: mx.array, values: mx.array, layer: int) -> tuple[mx.array, mx.array]:
        """Text K/V MLPs on every window of `factor` tokens: [..., S, D] -> [..., S // factor, D].

        What the KV policy and training use: S must be a multiple of factor and min_seq_len does not apply (the
        caller chose the windows to merge)."""
        c = self.config
        if keys.shape != values.shape or keys.shape[-1] != c.head_dim or keys.shape[-2] % c.factor:
            raise InvalidArgumentError(
                f"keys/values: expected equal shapes [..., S, {c.head_dim}] with S a multiple of {c.factor}, "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}")
        if not 0 <= layer < c.num_layers:
            raise InvalidArgumentError(f"layer: {layer} is out of range for a {c.num_layers}-layer compressor")
        return self._windows(keys, self.compress_tk[layer]), self._windows(values, self.compress_tv[layer])

    def merge_windows_from_arena(self, keys_buffer: mx.array, values_buffer: mx.array, table: Sequence[int],
                                 start: int, num_windows: int, layer: int, block_size: int) -> tuple[mx.array, mx.array]:
        """`merge_windows` on windows read straight from one layer's arena buffers ([H, slots, D]) through a
        block table: physical tokens [start, start + num_windows * factor). The grouped gather and the first
        Linear + ReLU run as one kernel (`kernels.compress_gather`: Metal, or its pure-MLX reference), so the
        grouped [H, N / factor, factor * D] tensor is never materialised on Metal; the other layers follow in MLX.
        The first layer is computed in float32 (the kernel's accumulator) whatever the weights' dtype."""
        from cortexstream.kernels.compress_gather import compress_gather

        c = self.config
        if keys_buffer.shape[-1] != c.head_dim or values_buffer.shape[-1] != c.head_dim:
            raise InvalidArgumentError(
                f"arena: keys/values of width {keys_buffer.shape[-1]}/{values_buffer.shape[-1]}, the compressor "
                f"was built for head_dim {c.head_dim}")
        if not 0 <= layer < c.num_layers:
            raise InvalidArgumentError(f"layer: {layer} is out of range for a {c.num_layers}-layer compressor")

        def run(buffer: mx.array, mlp: list[nn.Module]) -> mx.array:
            first = mlp[0]
            bias = first.bias if "bias" in first else mx.zeros((first.weight.shape[0],), first.weight.dtype)
            h = compress_gather(buffer, table, start, num_windows, c.factor, first.weight, bias, block_size)
            for module in mlp[2:]:  # mlp[1] is the ReLU the kernel applied
                h = module(h)
            return h.astype(buffer.dtype)

        return run(keys_buffer, self.compress_tk[layer]), run(values_buffer, self.compress_tv[layer])

    def compress(
        self, keys: mx.array, values: mx.array, layer: int, *, image_len: int = 0
    ) -> tuple[mx.array, mx.array]:
        """Compress one layer's K and V ([B, H, S, D] or [H, S, D]; D = head_dim) along S.

        The first `image_len` tokens (clamped to S) form the image segment, the rest the text segment. Each segment
        of s tokens becomes n = s // factor merged tokens followed by its s - n*factor remainder tokens, unless
        n < min_seq_len (or n == 0): then it is returned as is. Output dtype = input dtype.
        """
        c = self.config
        if keys.shape != values.shape or keys.ndim not in (3, 4) or keys.shape[-1] != c.head_dim:
            raise InvalidArgumentError(
                f"keys/values: expected equal shapes [B, H, S, {c.head_dim}] or [H, S, {c.head_dim}], "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}")
        if not 0 <= layer < c.num_layers:
            raise InvalidArgumentError(f"layer: {layer} is out of range for a {c.num_layers}-layer compressor")
        if image_len < 0:
            raise InvalidArgumentError(f"image_len: must be >= 0, got {image_len}")
        img = min(image_len, keys.shape[-2])
        tk = self._segment(keys[..., img:, :], self.compress_tk[layer])
        tv = self._segment(values[..., img:, :], self.compress_tv[layer])
        if img == 0:
            return tk, tv
        ik, iv = keys[..., :img, :], values[..., :img, :]
        if c.image:
            ik, iv = self._segment(ik, self.compress_ik[layer]), self._segment(iv, self.compress_iv[layer])
        return mx.concatenate([ik, tk], axis=-2), mx.concatenate([iv, tv], axis=-2)

    def __call__(
        self, kv_cache: Sequence[tuple[mx.array, mx.array]], image_len: int = 0
    ) -> list[tuple[mx.array, mx.array]]:
        """All layers at once, like the reference's forward: [(K, V)] per layer -> compressed [(K, V)]."""
        if len(kv_cache) != self.config.num_layers:
            raise InvalidArgumentError(f"kv_cache: {len(kv_cache)} layers, compressor has {self.config.num_layers}")
        return [self.compress(k, v, i, image_len=image_len) for i, (k, v) in enumerate(kv_cache)]

    # ---- weights in and out ----

    @classmethod
    def from_state_dict(cls, state: Mapping[str, mx.array], *, min_seq_len: int = 1, factor: int | None = None,
                        source: str = "state dict") -> "KVCompressor":
        """Build from reference-named weights (wrapper prefixes and `attention.*` are handled); shapes give the
        config: head_dim = out_features, factor = in_features // head_dim, layers = highest index + 1."""
        state = map_fastcache_state_dict(state, source)
        first = state.get("compress_tk.0.0.weight")
        if first is None or first.ndim != 2:
            raise ModelLoadError(f"{source}: no 'compress_tk.0.0.weight': not a FastCache-style KV compressor")
        head_dim, in_dim = first.shape
        if in_dim % head_dim:
            raise ModelLoadError(f"{source}: 'compress_tk.0.0.weight' {tuple(first.shape)}: in_features is not a "
                                 "multiple of out_features (head_dim)")
        if factor is not None and factor != in_dim // head_dim:
            raise ModelLoadError(f"{source}: factor {factor} does not match the weights (factor {in_dim // head_dim})")
        layers = 1 + max(int(m.group(1)) for k in state if (m := _LAYER.fullmatch(k)))
        image = any(k.startswith(("compress_ik.", "compress_iv.")) for k in state)
        model = cls(CompressorConfig(layers, head_dim, in_dim // head_dim, min_seq_len, image))
        load_strict(model, state, source, what=f"a {layers}-layer KV compressor (head_dim {head_dim})")
        return model

    @classmethod
    def from_file(cls, path: str, *, min_seq_len: int | None = None) -> "KVCompressor":
        """torch.save (.pth), safetensors (ours or foreign) or InfiniLM `.bin`; min_seq_len: argument, else the
        file's metadata/header, else 1 (the reference's default)."""
        ckpt = load_checkpoint(path)
        meta = ckpt.metadata
        try:
            msl = min_seq_len if min_seq_len is not None else int(meta.get("min_seq_len", 1))
            factor = int(meta["factor"]) if meta.get("factor", "0") not in ("0", "") else None
        except ValueError as exc:
            raise ModelLoadError(f"{path}: metadata 'min_seq_len'/'factor' is not an integer ({exc})") from exc
        check_finite(ckpt.tensors, path)  # NaN/inf weights would merge every window into garbage, silently
        return cls.from_state_dict(ckpt.tensors, min_seq_len=msl, factor=factor, source=path)

    def state_dict(self) -> dict[str, mx.array]:
        """Flat reference-named weights ('compress_tk.0.0.weight', ...)."""
        return dict(tree_flatten(self.parameters()))

    def save(self, path: str, *, dtype: str | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        """safetensors with the config in its metadata (what `from_file` reads back); dtype: e.g. "float16" to
        store smaller weights (None: as held); metadata: extra entries (training data, losses...)."""
        c = self.config
        state = self.state_dict()
        if dtype is not None:
            if dtype not in _STORE_DTYPES:
                raise InvalidArgumentError(f"dtype: '{dtype}' is not one of {', '.join(_STORE_DTYPES)}")
            state = {k: v.astype(_STORE_DTYPES[dtype]) for k, v in state.items()}
        save_safetensors(path, state, {**dict(metadata or {}), "format": FORMAT, "factor": str(c.factor),
                                       "min_seq_len": str(c.min_seq_len), "head_dim": str(c.head_dim),
                                       "num_layers": str(c.num_layers), "image": str(c.image).lower()})

    def save_infinilm_bin(self, path: str, *, dtype: str = "float16", num_heads: int = 0) -> None:
        """Export for InfiniLM (12 Linears per layer, or 6 when text-only)."""
        write_infinilm_bin(path, self.state_dict(), compression_factor=self.config.factor,
                           min_seq_len=self.config.min_seq_len, num_heads=num_heads, dtype=dtype)

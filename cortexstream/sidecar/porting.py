"""Sidecar weights in and out: our safetensors format, and PyTorch checkpoints through `cortexstream.port`.

Our format: one `.safetensors` file with the parameters under their MLX names and a JSON `cortexstream_sidecar`
metadata entry holding the `SidecarConfig` (plus free-form training info), so `load_sidecar` rebuilds the network
without guessing.

PyTorch: a reference module with the same structure and names (`in_proj`, `pos_embed`, `group_embed`,
`layers.{i}.{norm1,attn.{q,k,v,o}_proj,norm2,fc1,fc2}`, `norm`, `seed`, `pool.{q,k,v,o}_proj`, `k_out`, `v_out`,
`mass_out`; `nn.Linear` stores [out, in] like MLX, so no transposes) saved with `torch.save(module.state_dict())`,
or a dict `{"state_dict" | "model": ..., "config": {...}}`. It is read torch-free (`load_torch`), renamed by
`map_state_dict` (DDP `module.` and `sidecar.` prefixes are stripped) and loaded with `load_strict`: a missing,
extra or mis-shaped tensor is a `ModelLoadError` naming it, never a silently half-loaded network. Shapes give
head_dim, value_dim, window, d_model, encoder depth and MLP ratio; what shapes cannot tell (attention heads, the
layer x head split of the group table, log_mass) comes from the checkpoint's "config" or the arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import mlx.core as mx
from mlx.utils import tree_flatten

from cortexstream.errors import ModelLoadError
from cortexstream.port import load_checkpoint, load_safetensors, load_strict, map_state_dict, save_safetensors
from cortexstream.port.torch_pickle import read_torch_file
from cortexstream.sidecar.network import SidecarConfig, SidecarNet

META_KEY = "cortexstream_sidecar"
_TORCH_RULES = [(r"(?:module\.)?(?:sidecar\.)?(.+)", r"\1")]


def save_sidecar(net: SidecarNet, path: str, info: Mapping[str, Any] | None = None) -> None:
    """Parameters (MLX names) + {"config": ..., **info} as JSON metadata, in one `.safetensors` file."""
    if not path.endswith(".safetensors"):
        raise ModelLoadError(f"{path}: sidecar files must end in .safetensors")
    meta = {META_KEY: json.dumps({"config": net.config.to_dict(), **dict(info or {})})}
    save_safetensors(path, dict(tree_flatten(net.parameters())), meta)


def read_sidecar_info(path: str) -> dict[str, Any]:
    """The JSON metadata of a sidecar file (config and training info)."""
    _, metadata = load_safetensors(path)
    if META_KEY not in metadata:
        raise ModelLoadError(f"{path}: not a CortexStream sidecar (no '{META_KEY}' metadata)")
    return json.loads(metadata[META_KEY])


def load_sidecar(path: str) -> SidecarNet:
    """Rebuild a network written by `save_sidecar` (eval mode, float32)."""
    tensors, metadata = load_safetensors(path)
    if META_KEY not in metadata:
        raise ModelLoadError(f"{path}: not a CortexStream sidecar (no '{META_KEY}' metadata)")
    try:
        config = SidecarConfig.from_dict(json.loads(metadata[META_KEY])["config"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: bad sidecar config ({exc})") from exc
    net = SidecarNet(config)
    load_strict(net, tensors, path, dtype=mx.float32, what="SidecarNet")
    net.eval()
    return net


def config_from_state(state: Mapping[str, mx.array], source: str, **given: Any) -> SidecarConfig:
    """Infer a `SidecarConfig` from parameter shapes; `given` supplies num_heads, num_layers/num_kv_heads, log_mass."""
    try:
        d_model, inputs = state["in_proj.weight"].shape
        head_dim, value_dim = state["k_out.weight"].shape[0], state["v_out.weight"].shape[0]
        window, groups = state["pos_embed.weight"].shape[0], state["group_embed.weight"].shape[0]
        hidden = state["layers.0.fc1.weight"].shape[0] if "layers.0.fc1.weight" in state else 4 * d_model
    except KeyError as exc:
        raise ModelLoadError(f"{source}: not a sidecar state dict (missing {exc})") from exc
    depth = len({m.group(1) for k in state if (m := re.match(r"layers\.(\d+)\.", k))})
    num_kv_heads = int(given.get("num_kv_heads") or 0)
    num_layers = int(given.get("num_layers") or 0)
    if not num_layers and not num_kv_heads:
        num_layers, num_kv_heads = groups, 1
    elif not num_layers:
        num_layers = groups // num_kv_heads
    elif not num_kv_heads:
        num_kv_heads = groups // num_layers
    if num_layers * num_kv_heads != groups or inputs != head_dim + value_dim + 2:
        raise ModelLoadError(f"{source}: {groups} group embeddings != {num_layers} layers x {num_kv_heads} KV heads, "
                             f"or in_proj takes {inputs} inputs for head_dim {head_dim} + value_dim {value_dim} + 2")
    return SidecarConfig(head_dim=head_dim, value_dim=0 if value_dim == head_dim else value_dim, window=window,
                         num_layers=num_layers, num_kv_heads=num_kv_heads, d_model=d_model, encoder_layers=depth,
                         num_heads=int(given.get("num_heads", 4)), mlp_ratio=hidden // d_model,
                         log_mass=bool(given.get("log_mass", True)))


def load_torch_sidecar(path: str, *, num_layers: int | None = None, num_kv_heads: int | None = None,
                       num_heads: int | None = None, log_mass: bool | None = None) -> SidecarNet:
    """A PyTorch sidecar checkpoint (state dict, or {"state_dict"/"model": ..., "config": ...}) as a SidecarNet."""
    checkpoint = load_checkpoint(path)
    stored: dict[str, Any] = {}
    if checkpoint.format.startswith("torch"):
        tree = read_torch_file(path)
        if isinstance(tree, dict) and isinstance(tree.get("config"), dict):
            stored = dict(tree["config"])
    raw = checkpoint.tensors
    for prefix in ("state_dict.", "model."):
        if raw and all(k.startswith(prefix) for k in raw):
            raw = {k[len(prefix):]: v for k, v in raw.items()}
    state = map_state_dict(raw, _TORCH_RULES, source=path)
    given = {**stored, **{k: v for k, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                                              ("num_heads", num_heads), ("log_mass", log_mass)) if v is not None}}
    config = config_from_state(state, path, **given)
    net = SidecarNet(config)
    load_strict(net, state, path, dtype=mx.float32, what="SidecarNet")
    net.eval()
    return net

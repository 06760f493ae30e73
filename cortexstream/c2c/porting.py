"""Loading fusers trained elsewhere, and saving ours, through `cortexstream.port` (torch-free).

thu-nics layout (source: thu-nics/C2C `script/train/SFT_train.py` saves, `rosetta/utils/evaluate.py` and
`script/playground/live_chat_example.py` load; `rosetta/utils/registry.py` `save_object`):
    projector_{i}.pt        torch.save(proj.state_dict()): key_in.weight, key_mlp1.blocks.0.norm.weight, ...,
                            key_gate_logit (0-dim), gate_temperature (buffer), same for value_*
    projector_{i}.json      {"class": "C2CProjector", "init_args": {source_dim, target_dim, ..., "dtype":
                            {"__type__": "torch.dtype", "value": "bfloat16"}}}
    projector_config.json   {target_model_idx: {source_model_idx: {target_layer: [[source_layer, proj_idx], ...]}}}
                            (json string keys; model 0 is the receiver, 1.. the sharers)
Only `C2CProjector` is ported (the paper's; `AllInOneProjector` and ablation classes raise). The reference loads
with `strict=False`; we load strictly (a silently missing tensor gives a fuser that runs and computes garbage),
reading `gate_temperature` into the projector's float attribute.

Seed low-rank state dicts: `projectors.{i}.{k,v}_{down,up}.weight` and `gate.alpha` (aliases `projector.{i}`,
`cache_projectors.{i}`, `layer_gate.alpha`, `gates.alpha` accepted); n_layers, head_dim and rank come from the shapes.

Our own format: one safetensors file, parameters by their MLX names plus a JSON `cortexstream_c2c` metadata
entry (kind, constructor arguments, layer map) so `load_fuser` rebuilds the module without guessing.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from typing import Any, Mapping

import mlx.core as mx
from mlx.utils import tree_flatten

from cortexstream.c2c.fusion import CacheFuser
from cortexstream.c2c.lowrank import C2CFuser
from cortexstream.c2c.projector import C2CProjector, C2CProjectorFuser
from cortexstream.errors import ModelLoadError
from cortexstream.port import load_checkpoint, load_safetensors, load_strict, map_state_dict, save_safetensors

META_KEY = "cortexstream_c2c"
_PROJECTOR_ARGS = set(inspect.signature(C2CProjector.__init__).parameters) - {"self"}
_LOWRANK_RULES = [
    (r"(?:cache_)?projectors?\.(\d+)\.([kv]_(?:down|up)\.weight)", r"projectors.\1.\2"),
    (r"(?:layer_)?gates?\.alpha", "gate.alpha"),
]


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc


def _projector_args(path: str) -> dict[str, Any]:
    payload = _read_json(path)
    cls = str(payload.get("class", ""))
    if cls.lower() != "c2cprojector":
        raise ModelLoadError(f"{path}: projector class {cls!r} is not supported (only C2CProjector is ported)")
    args = {k: v for k, v in dict(payload.get("init_args", {})).items() if k != "dtype"}
    unknown = sorted(set(args) - _PROJECTOR_ARGS)
    if unknown:
        raise ModelLoadError(f"{path}: unknown C2CProjector arguments {unknown}")
    return args


def _plan(
    config: Mapping[str, Any], path: str, target_index: int, source_index: int | None
) -> dict[int, tuple[int, int]]:
    sources = config.get(str(target_index))
    if not isinstance(sources, dict) or not sources:
        raise ModelLoadError(f"{path}: no projectors for target model {target_index}")
    if source_index is None:
        if len(sources) != 1:
            raise ModelLoadError(f"{path}: several sharers {sorted(sources)}; pass source_model_index")
        layers = next(iter(sources.values()))
    elif str(source_index) in sources:
        layers = sources[str(source_index)]
    else:
        raise ModelLoadError(f"{path}: no sharer {source_index} (has {sorted(sources)})")
    try:
        # The reference uses only the first (source layer, projector) pair of each target layer.
        return {int(t): (int(pairs[0][0]), int(pairs[0][1])) for t, pairs in layers.items() if pairs}
    except (TypeError, ValueError, IndexError) as exc:
        raise ModelLoadError(f"{path}: malformed layer mapping ({exc})") from exc


def load_projector(json_path: str, pt_path: str) -> C2CProjector:
    """One thu-nics projector (`projector_{i}.json` + `projector_{i}.pt`) as an MLX `C2CProjector` (float32)."""
    projector = C2CProjector(**_projector_args(json_path))
    state = load_checkpoint(pt_path).tensors
    temperature = state.pop("gate_temperature", None)
    load_strict(projector, state, pt_path, dtype=mx.float32)
    if temperature is not None:
        projector.gate_temperature = float(temperature.astype(mx.float32).item())
    projector.eval()
    return projector


def load_c2c_checkpoint(
    directory: str,
    *,
    num_target_layers: int | None = None,
    num_source_layers: int | None = None,
    target_model_index: int = 0,
    source_model_index: int | None = None,
) -> C2CProjectorFuser:
    """A thu-nics checkpoint directory as a `C2CProjectorFuser`. Pass the two models' layer counts (else the
    highest mapped layer + 1 is assumed, and the fuser refuses caches of other depths)."""
    config_path = os.path.join(directory, "projector_config.json")
    if not os.path.exists(config_path):
        raise ModelLoadError(f"{directory}: no projector_config.json (not a thu-nics C2C checkpoint)")
    indices = sorted(int(m.group(1)) for f in os.listdir(directory) if (m := re.fullmatch(r"projector_(\d+)\.pt", f)))
    if indices != list(range(len(indices))) or not indices:
        raise ModelLoadError(f"{directory}: projector_{{i}}.pt files must be numbered 0..n-1, found {indices}")
    projectors = [load_projector(os.path.join(directory, f"projector_{i}.json"),
                                 os.path.join(directory, f"projector_{i}.pt")) for i in indices]
    layer_map = _plan(_read_json(config_path), config_path, target_model_index, source_model_index)
    n_t = num_target_layers if num_target_layers is not None else max(layer_map) + 1
    n_s = num_source_layers if num_source_layers is not None else max(s for s, _ in layer_map.values()) + 1
    try:
        return C2CProjectorFuser(projectors, layer_map, n_t, n_s)
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from exc


def load_lowrank(path_or_state: str | Mapping[str, mx.array], gate_init: float = 0.0) -> C2CFuser:
    """The seed's low-rank fuser from a torch.save / safetensors state dict (or an already loaded dict)."""
    source = path_or_state if isinstance(path_or_state, str) else "state dict"
    raw = load_checkpoint(path_or_state).tensors if isinstance(path_or_state, str) else dict(path_or_state)
    state = map_state_dict(raw, _LOWRANK_RULES, source=source)
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"projectors\.(\d+)\.", k))})
    if not layers or "projectors.0.k_down.weight" not in state:
        raise ModelLoadError(f"{source}: no low-rank projector weights (projectors.{{i}}.k_down.weight)")
    rank, head_dim = state["projectors.0.k_down.weight"].shape
    fuser = C2CFuser(n_layers=len(layers), head_dim=head_dim, rank=rank, gate_init=gate_init)
    if "gate.alpha" not in state:  # a projector-only file: keep the requested initial gate
        state["gate.alpha"] = fuser.gate.alpha
    load_strict(fuser, state, source, dtype=mx.float32)
    return fuser


# --- our own safetensors format ----------------------------------------------------------------------------------
def describe_fuser(fuser: CacheFuser) -> dict[str, Any]:
    if isinstance(fuser, C2CFuser):
        return {"kind": "lowrank", **fuser.config()}
    if isinstance(fuser, C2CProjectorFuser):
        return {
            "kind": "c2c_projector",
            "num_target_layers": fuser.n_target, "num_source_layers": fuser.n_source,
            "layer_map": [[t, s, p] for t, s, p in fuser.plan.pairs],
            "projectors": [dict(p.init_args) for p in fuser.projectors],
            "gate_temperatures": [p.gate_temperature for p in fuser.projectors],
        }
    raise ModelLoadError(f"save_fuser: cannot describe {type(fuser).__name__}")


def save_fuser(fuser: CacheFuser, path: str) -> None:
    """Parameters (MLX names) + a JSON description, as one `.safetensors` file."""
    if not path.endswith(".safetensors"):
        raise ModelLoadError(f"{path}: fuser files must end in .safetensors")
    tensors = dict(tree_flatten(fuser.parameters()))
    save_safetensors(path, tensors, {META_KEY: json.dumps(describe_fuser(fuser))})


def load_fuser(path: str) -> CacheFuser:
    """Rebuild a fuser written by `save_fuser`."""
    tensors, metadata = load_safetensors(path)
    if META_KEY not in metadata:
        raise ModelLoadError(f"{path}: not a CortexStream C2C fuser (no '{META_KEY}' metadata)")
    info = json.loads(metadata[META_KEY])
    if info.get("kind") == "lowrank":
        fuser: CacheFuser = C2CFuser(n_layers=info["n_layers"], head_dim=info["head_dim"], rank=info["rank"])
    elif info.get("kind") == "c2c_projector":
        projectors = [C2CProjector(**args) for args in info["projectors"]]
        for projector, temperature in zip(projectors, info["gate_temperatures"]):
            projector.gate_temperature = float(temperature)
        fuser = C2CProjectorFuser(projectors, {t: (s, p) for t, s, p in info["layer_map"]},
                                  info["num_target_layers"], info["num_source_layers"])
    else:
        raise ModelLoadError(f"{path}: unknown fuser kind {info.get('kind')!r}")
    load_strict(fuser, tensors, path)
    fuser.eval()
    return fuser

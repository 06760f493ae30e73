"""Sidecar weights shipped inside the package (`cortexstream/sidecar/weights/*.safetensors`) and a process-wide
cache of loaded networks.

Why a module-level cache: KV policies are frozen dataclasses (hashable, comparable, parsed from strings), so a
policy holds only the weights *path*; the network is loaded on first use and shared by every request and policy
instance that names the same file. Shipped files are found by the `config` stored in each file's metadata
(window, head_dim, value_dim, KV heads and layers of the model it was trained on), never by file name.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.sidecar.network import SidecarNet
from cortexstream.sidecar.porting import load_sidecar, read_sidecar_info

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")

_NETS: dict[str, SidecarNet] = {}
_LOCK = threading.Lock()


def shipped_files(directory: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(path, metadata) of every sidecar file in `directory` (default: the package's), sorted by name; files that
    are not sidecars are skipped."""
    directory = WEIGHTS_DIR if directory is None else directory
    if not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        try:
            out.append((path, read_sidecar_info(path)))
        except (ModelLoadError, OSError, ValueError):
            continue
    return out


def find_shipped(window: int, head_dim: int, value_dim: int, num_kv_heads: int, num_layers: int | None = None,
                 directory: str | None = None) -> str:
    """The shipped file trained for exactly this window and cache shape; InvalidArgumentError if none (or two)."""
    matches, available = [], []
    for path, info in shipped_files(directory):
        cfg = info.get("config", {})
        vdim = cfg.get("value_dim") or cfg.get("head_dim")
        available.append(f"{os.path.basename(path)} (window {cfg.get('window')}, {cfg.get('num_layers')} layers x "
                         f"{cfg.get('num_kv_heads')} KV heads x head_dim {cfg.get('head_dim')})")
        if (cfg.get("window"), cfg.get("head_dim"), vdim, cfg.get("num_kv_heads")) == \
                (window, head_dim, value_dim, num_kv_heads) and num_layers in (None, cfg.get("num_layers")):
            matches.append(path)
    if len(matches) == 1:
        return matches[0]
    shape = (f"window {window}, {num_kv_heads} KV heads, head_dim {head_dim}, value_dim {value_dim}"
             + (f", {num_layers} layers" if num_layers is not None else ""))
    if not matches:
        have = "; ".join(available) or "none"
        raise InvalidArgumentError(f"sidecar: weights=None but no shipped weights match {shape} (shipped: {have}); "
                                   "train some with `cortexstream train sidecar --export FILE` and pass weights=FILE")
    raise InvalidArgumentError(f"sidecar: several shipped weights match {shape}: {matches}; pass weights=PATH")


def load_cached(path: str) -> SidecarNet:
    """Load a sidecar file once per process (thread-safe); errors name the file."""
    key = os.path.realpath(path)
    with _LOCK:
        net = _NETS.get(key)
        if net is None:
            if not os.path.isfile(key):
                raise InvalidArgumentError(f"sidecar: weights file '{path}' does not exist")
            net = load_sidecar(key)
            _NETS[key] = net
        return net


def clear_cache() -> None:
    with _LOCK:
        _NETS.clear()

"""The C2C paper's fuser for models of different shapes: one `C2CProjector` per receiver layer.

Source: thu-nics/C2C `rosetta/model/projector.py` (`C2CProjector`, `RegularMLP`, `StandardFFNLayer`) and
`rosetta/model/wrapper.py` (`RosettaModel.forward`: which layers/tokens are fused). Facts used, per receiver layer:
- inputs are the sharer's and receiver's post-RoPE cache K (and separately V), `[B, H, N, D]`; heads are
  flattened per token (`[B, N, H*D]`) and the sharer's and receiver's are concatenated along channels;
- `key_in`: Linear(Hs*Ds + Ht*Dt -> hidden, bias) then `key_mlp1`: one FFN sublayer;
  FFN sublayer = `x + Dropout(w2(GELU(w1(RMSNorm(x)))))`, RMSNorm eps 1e-6, bias-free w1/w2 (exact-erf GELU);
- projected path: `key_proj_mlp2` (num_layers - 2 sublayers, intermediate_dim) then `key_proj_out`:
  Linear(hidden -> Ht*Dt, bias), reshaped to the receiver's `[B, Ht, N, Dt]`;
- weight path: `key_scalar_mlp2` (one sublayer, intermediate = hidden) then `key_scalar_head`:
  Linear(hidden -> Ht, bias), one weight per head and token, normalised by sigmoid;
- gate: one scalar logit each for K and V (`key_gate_logit`, `value_gate_logit`, init 0). Training: Gumbel
  sigmoid `sigmoid((logit + gumbel) / T)`, noise per (batch, head, token), T annealed geometrically from
  `initial_temperature` to `final_temperature` over `anneal_steps` (`update_temperature`). Inference: hard gate
  `logit > 0`, so an untrained projector (logit 0) is closed;
- residual output: `K_t + gate * sigmoid(w) * projected` (the receiver is kept, nothing is blended away);
- the same (value_*) structure for V. All layers are fused over the prompt except its last token, which the
  receiver then computes on the fused cache (`kv_cache_index` sections in the README): see `pipeline.py`.
- the reference only ever uses the first (sharer layer, projector) pair listed for a receiver layer; so do we.

Choices: arithmetic in float32, output cast to the receiver's dtype; a closed gate at inference returns the
receiver's array itself (bit-identical, no write). Module and parameter names equal the reference's, so its
state dicts load by name (`porting.py`); `gate_temperature` (a buffer there) is a plain float here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn

from cortexstream.c2c.alignment import k_nearest, last_aligned
from cortexstream.c2c.fusion import CacheFuser, LayerKV, check_same_tokens
from cortexstream.errors import InvalidArgumentError


class StandardFFNLayer(nn.Module):
    """Pre-RMSNorm residual FFN sublayer: `x + drop(w2(gelu(w1(norm(x)))))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.drop(self.w2(self.act(self.w1(self.norm(x)))))


class RegularMLP(nn.Module):
    def __init__(self, hidden_dim: int, intermediate_dim: int, num_layers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = [StandardFFNLayer(hidden_dim, intermediate_dim, dropout) for _ in range(num_layers)]

    def __call__(self, x: mx.array) -> mx.array:
        for block in self.blocks:
            x = block(x)
        return x


class C2CProjector(nn.Module):
    """One receiver layer's projector (thu-nics `C2CProjector`, same constructor arguments minus `dtype`)."""

    def __init__(
        self, source_dim: int, target_dim: int, source_num_heads: int = 1, target_num_heads: int = 1,
        intermediate_dim: int = 1024, hidden_dim: int = 1024, num_layers: int = 3, dropout: float = 0.1,
        initial_temperature: float = 1.0, final_temperature: float = 0.001, anneal_steps: int = 1929,
        zero_init: bool = False,
    ) -> None:
        super().__init__()
        if num_layers < 3:
            raise InvalidArgumentError(f"C2CProjector: num_layers={num_layers} must be >= 3 (as the reference)")
        self.source_dim, self.target_dim = int(source_dim), int(target_dim)
        self.source_num_heads, self.target_num_heads = int(source_num_heads), int(target_num_heads)
        in_dim, out_dim = source_dim * source_num_heads, target_dim * target_num_heads
        for kind in ("key", "value"):
            setattr(self, f"{kind}_in", nn.Linear(in_dim + out_dim, hidden_dim))
            setattr(self, f"{kind}_mlp1", RegularMLP(hidden_dim, intermediate_dim, 1, dropout))
            setattr(self, f"{kind}_scalar_mlp2", RegularMLP(hidden_dim, hidden_dim, 1, dropout))
            setattr(self, f"{kind}_scalar_head", nn.Linear(hidden_dim, target_num_heads))
            setattr(self, f"{kind}_proj_mlp2", RegularMLP(hidden_dim, intermediate_dim, num_layers - 2, dropout))
            out = nn.Linear(hidden_dim, out_dim)
            if zero_init:
                out.weight, out.bias = mx.zeros_like(out.weight), mx.zeros_like(out.bias)
            setattr(self, f"{kind}_proj_out", out)
            setattr(self, f"{kind}_gate_logit", mx.array(0.0))
        self.use_gumbel = True
        self.initial_temperature, self.final_temperature = float(initial_temperature), float(final_temperature)
        self.anneal_steps = int(anneal_steps)
        self.gate_temperature = float(initial_temperature)
        self.init_args = {
            "source_dim": source_dim, "target_dim": target_dim, "source_num_heads": source_num_heads,
            "target_num_heads": target_num_heads, "intermediate_dim": intermediate_dim, "hidden_dim": hidden_dim,
            "num_layers": num_layers, "dropout": dropout, "initial_temperature": initial_temperature,
            "final_temperature": final_temperature, "anneal_steps": anneal_steps,
        }

    def update_temperature(self, step: int) -> None:
        ratio = min(step / self.anneal_steps, 1.0)
        self.gate_temperature = self.initial_temperature * (self.final_temperature / self.initial_temperature) ** ratio

    def gate_open(self, kind: str) -> bool:
        """Inference gate (`logit > 0`) for "key" or "value"."""
        return bool(getattr(self, f"{kind}_gate_logit").item() > 0)

    def _one(self, kind: str, source: mx.array, target: mx.array, key: mx.array | None) -> mx.array:
        if not self.training and not self.gate_open(kind):
            return target  # closed: the receiver's own array, untouched
        b, hs, n, ds = source.shape
        _, ht, _, dt = target.shape
        if (hs, ds, ht, dt) != (self.source_num_heads, self.source_dim, self.target_num_heads, self.target_dim):
            raise InvalidArgumentError(
                f"C2CProjector built for source {self.source_num_heads}x{self.source_dim} -> target "
                f"{self.target_num_heads}x{self.target_dim} heads x dim, got {hs}x{ds} -> {ht}x{dt}")
        flat_s = source.astype(mx.float32).transpose(0, 2, 1, 3).reshape(b, n, hs * ds)
        flat_t = target.astype(mx.float32).transpose(0, 2, 1, 3).reshape(b, n, ht * dt)
        hidden = getattr(self, f"{kind}_mlp1")(getattr(self, f"{kind}_in")(mx.concatenate([flat_s, flat_t], axis=-1)))
        proj = getattr(self, f"{kind}_proj_out")(getattr(self, f"{kind}_proj_mlp2")(hidden))
        proj = proj.reshape(b, n, ht, dt).transpose(0, 2, 1, 3)
        weight = getattr(self, f"{kind}_scalar_head")(getattr(self, f"{kind}_scalar_mlp2")(hidden))
        weight = mx.sigmoid(weight.transpose(0, 2, 1)[..., None])  # [B, Ht, N, 1]
        logit = getattr(self, f"{kind}_gate_logit")
        if self.training and self.use_gumbel:
            u = mx.random.uniform(shape=(b, ht, n, 1), key=key)
            gumbel = -mx.log(-mx.log(u + 1e-20) + 1e-20)
            gate = mx.sigmoid((logit + gumbel) / self.gate_temperature)
        else:
            gate = (logit > 0).astype(mx.float32)
        return (target.astype(mx.float32) + gate * weight * proj).astype(target.dtype)

    def __call__(
        self, source_kv: LayerKV, target_kv: LayerKV, key: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """(K, V) of the receiver after fusion, `[B, Ht, N, Dt]`; `key` seeds the training-time Gumbel noise."""
        kk, vk = mx.random.split(key) if key is not None else (None, None)
        return self._one("key", source_kv[0], target_kv[0], kk), self._one("value", source_kv[1], target_kv[1], vk)


@dataclass(frozen=True)
class LayerPlan:
    """Receiver layer -> (sharer layer, projector index), the reference's `projector_dict[target][source]`."""

    pairs: tuple[tuple[int, int, int], ...]  # (target layer, source layer, projector index), sorted by target

    def as_dict(self) -> dict[int, tuple[int, int]]:
        return {t: (s, p) for t, s, p in self.pairs}


class C2CProjectorFuser(CacheFuser):
    """Per receiver layer, a `C2CProjector` fed by one sharer layer (last-aligned by default)."""

    def __init__(self, projectors: Sequence[C2CProjector], layer_map: Mapping[int, tuple[int, int]],
                 num_target_layers: int, num_source_layers: int) -> None:
        super().__init__()
        self.projectors = list(projectors)
        for t, (s, p) in layer_map.items():
            if not (0 <= t < num_target_layers and 0 <= s < num_source_layers and 0 <= p < len(self.projectors)):
                raise InvalidArgumentError(
                    f"layer_map: {t} -> ({s}, projector {p}) out of range for {num_target_layers}/"
                    f"{num_source_layers} layers, {len(self.projectors)} projectors")
        self.plan = LayerPlan(tuple(sorted((int(t), int(s), int(p)) for t, (s, p) in layer_map.items())))
        self.n_target, self.n_source = int(num_target_layers), int(num_source_layers)
        self.eval()

    @classmethod
    def create(
        cls, *, source_layers: int, target_layers: int, source_heads: int, source_head_dim: int,
        target_heads: int, target_head_dim: int, mapping: str = "last_aligned", clamp: bool = True,
        hidden_dim: int = 1024, intermediate_dim: int = 1024, num_layers: int = 3, dropout: float = 0.1,
        **projector_kwargs: Any,
    ) -> "C2CProjectorFuser":
        """A fresh fuser, one projector per mapped receiver layer (projector i serves the i-th mapped layer)."""
        if mapping == "last_aligned":
            layers = last_aligned(target_layers, source_layers, clamp=clamp)
        elif mapping == "k_nearest":
            layers = k_nearest(target_layers, source_layers)
        else:
            raise InvalidArgumentError(f"mapping: {mapping!r} must be 'last_aligned' or 'k_nearest'")
        projectors, layer_map = [], {}
        for t in sorted(layers):
            layer_map[t] = (layers[t][0], len(projectors))
            projectors.append(C2CProjector(source_head_dim, target_head_dim, source_heads, target_heads,
                                           intermediate_dim, hidden_dim, num_layers, dropout, **projector_kwargs))
        return cls(projectors, layer_map, target_layers, source_layers)

    @classmethod
    def from_models(cls, source_model: Any, target_model: Any, **kwargs: Any) -> "C2CProjectorFuser":
        """Shapes read from two mlx-lm models (sharer, receiver)."""
        from cortexstream.kv.arena_config import model_kv_shape

        sl, sh, sd, _ = model_kv_shape(source_model)
        tl, th, td, _ = model_kv_shape(target_model)
        return cls.create(source_layers=sl, target_layers=tl, source_heads=sh, source_head_dim=sd,
                          target_heads=th, target_head_dim=td, **kwargs)

    @property
    def num_target_layers(self) -> int:
        return self.n_target

    @property
    def layer_map(self) -> dict[int, tuple[int, int]]:
        return self.plan.as_dict()

    def open_layers(self, num_source_layers: int) -> list[bool]:
        mapped = self.layer_map
        return [t in mapped and (self.projectors[mapped[t][1]].gate_open("key")
                                 or self.projectors[mapped[t][1]].gate_open("value"))
                for t in range(self.n_target)]

    def fused_layers(
        self, src: Sequence[LayerKV], tgt: Sequence[LayerKV], active: Sequence[bool] | None = None,
        key: mx.array | None = None,
    ) -> list[LayerKV]:
        self._check_target_layers(len(tgt))
        if len(src) != self.n_source:
            raise InvalidArgumentError(f"src_cache has {len(src)} layers, the fuser was built for {self.n_source}")
        mapped = self.layer_map
        keys = iter(mx.random.split(key, self.n_target)) if key is not None else None
        out: list[LayerKV] = []
        for t, pair in enumerate(tgt):
            layer_key = next(keys) if keys is not None else None
            if t not in mapped or (active is not None and not active[t]):
                out.append(pair)
                continue
            s, p = mapped[t]
            check_same_tokens(src[s], pair, s, t)
            out.append(self.projectors[p](src[s], pair, layer_key))
        return out

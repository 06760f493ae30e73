"""Porting sidecar weights: an independent PyTorch module with the same structure and names, saved with torch.save,
loaded torch-free, must give the same beads to 1e-5; our safetensors format round-trips; bad files raise."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import ModelLoadError
from cortexstream.sidecar import SidecarConfig, SidecarNet, load_sidecar, load_torch_sidecar, save_sidecar

torch = pytest.importorskip("torch")
tnn = torch.nn
pytestmark = pytest.mark.torch_ref


class TorchAttention(tnn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (tnn.Linear(d, d) for _ in range(4))

    def forward(self, xq, xkv):
        b, lq, d = xq.shape
        lk, h = xkv.shape[1], self.h
        q = self.q_proj(xq).view(b, lq, h, d // h).transpose(1, 2)
        k = self.k_proj(xkv).view(b, lk, h, d // h).transpose(1, 2)
        v = self.v_proj(xkv).view(b, lk, h, d // h).transpose(1, 2)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, lq, d)), w


class TorchLayer(tnn.Module):
    def __init__(self, d, heads, ratio):
        super().__init__()
        self.norm1, self.norm2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
        self.attn = TorchAttention(d, heads)
        self.fc1, self.fc2 = tnn.Linear(d, ratio * d), tnn.Linear(ratio * d, d)

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attn(y, y)[0]
        return x + self.fc2(tnn.functional.gelu(self.fc1(self.norm2(x))))


class TorchSidecar(tnn.Module):
    """The sidecar stated independently in PyTorch: RMS-normalised inputs, encoder, PMA pooling, residual heads."""

    def __init__(self, dk, dv, n, groups, d, depth, heads, ratio):
        super().__init__()
        self.in_proj = tnn.Linear(dk + dv + 2, d)
        self.pos_embed, self.group_embed = tnn.Embedding(n, d), tnn.Embedding(groups, d)
        self.layers = tnn.ModuleList([TorchLayer(d, heads, ratio) for _ in range(depth)])
        self.norm = tnn.LayerNorm(d)
        self.seed = tnn.Parameter(torch.randn(1, d) * 0.5)
        self.pool = TorchAttention(d, heads)
        self.k_out, self.v_out, self.mass_out = tnn.Linear(d, dk), tnn.Linear(d, dv), tnn.Linear(d, 1)

    def forward(self, keys, values, group):  # [B, N, D], [B, N, Dv], [B]
        rk = torch.sqrt(keys.pow(2).mean(dim=(1, 2), keepdim=True) + 1e-6)
        rv = torch.sqrt(values.pow(2).mean(dim=(1, 2), keepdim=True) + 1e-6)
        n = keys.shape[1]
        feats = torch.cat([keys / rk, values / rv, torch.log(rk).expand(-1, n, 1), torch.log(rv).expand(-1, n, 1)], -1)
        x = self.in_proj(feats) + self.pos_embed.weight[:n] + self.group_embed(group)[:, None]
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        z, w = self.pool(self.seed.expand(x.shape[0], 1, -1), x)
        z, a = z[:, 0], w[:, :, 0].mean(dim=1)
        k = (a[..., None] * keys).sum(1) + rk[:, 0] * self.k_out(z)
        v = (a[..., None] * values).sum(1) + rv[:, 0] * self.v_out(z)
        mass = -(a * torch.log(a)).sum(-1) + self.mass_out(z)[:, 0]
        return k, v, mass


def _reference(seed=0, dv=16):
    torch.manual_seed(seed)
    ref = TorchSidecar(16, dv, 8, 6, 32, 2, 4, 3).eval()
    with torch.no_grad():
        for p in ref.parameters():  # non-trivial everywhere, including the (zero-initialised in MLX) heads
            p.add_(torch.randn_like(p) * 0.05)
    return ref


def _compare(net, ref, dv=16):
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(5, 8, 16)).astype(np.float32) * 3, rng.normal(size=(5, 8, dv)).astype(np.float32)
    group = np.array([0, 1, 2, 3, 5])
    with torch.no_grad():
        expected = ref(torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(group))
    got = net(mx.array(keys), mx.array(values), mx.array(group.astype(np.int32)))
    for e, g in zip(expected, got):
        np.testing.assert_allclose(np.array(g), e.numpy(), atol=1e-5, rtol=1e-5)


def test_torch_state_dict_parity(tmp_path):
    ref = _reference(dv=24)
    path = str(tmp_path / "sidecar.pt")
    torch.save(ref.state_dict(), path)
    net = load_torch_sidecar(path, num_layers=3, num_heads=4)
    assert net.config == SidecarConfig(head_dim=16, value_dim=24, window=8, num_layers=3, num_kv_heads=2, d_model=32,
                                       encoder_layers=2, num_heads=4, mlp_ratio=3)
    _compare(net, ref, dv=24)


def test_torch_checkpoint_with_config_and_ddp_prefix(tmp_path):
    ref = _reference(1)
    state = {f"module.{k}": v for k, v in ref.state_dict().items()}
    path = str(tmp_path / "ckpt.pt")
    torch.save({"state_dict": state, "config": {"num_layers": 2, "num_kv_heads": 3, "num_heads": 4}, "epoch": 3}, path)
    net = load_torch_sidecar(path)
    assert (net.config.num_layers, net.config.num_kv_heads) == (2, 3)
    _compare(net, ref)
    # round trip through our own format
    out = str(tmp_path / "sidecar.safetensors")
    save_sidecar(net, out, {"note": "ported"})
    _compare(load_sidecar(out), ref)


def test_bad_checkpoints_raise(tmp_path):
    ref = _reference(2)
    state = dict(ref.state_dict())
    state.pop("layers.1.fc2.bias")
    path = str(tmp_path / "missing.pt")
    torch.save(state, path)
    with pytest.raises(ModelLoadError, match="layers.1.fc2.bias"):
        load_torch_sidecar(path, num_layers=6, num_heads=4)
    torch.save({"weight": torch.zeros(3)}, str(tmp_path / "other.pt"))
    with pytest.raises(ModelLoadError, match="not a sidecar"):
        load_torch_sidecar(str(tmp_path / "other.pt"))
    with pytest.raises(ModelLoadError, match="group embeddings"):
        load_torch_sidecar(_save(ref, tmp_path), num_layers=4)
    net = SidecarNet(SidecarConfig(head_dim=16, window=8, num_layers=1, num_kv_heads=1, d_model=32, encoder_layers=1))
    with pytest.raises(ModelLoadError, match=".safetensors"):
        save_sidecar(net, str(tmp_path / "x.bin"))


def _save(ref, tmp_path) -> str:
    path = str(tmp_path / "ok.pt")
    torch.save(ref.state_dict(), path)
    return path

"""Porting C2C fusers: PyTorch modules with the references' structure and names (thu-nics `C2CProjector`, the seed's
low-rank fuser), saved with torch.save in their layouts, loaded torch-free, must match to 1e-5; our safetensors
format round-trips; malformed checkpoints raise ModelLoadError naming the problem."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.c2c import C2CFuser, C2CProjectorFuser
from cortexstream.c2c.porting import load_c2c_checkpoint, load_fuser, load_lowrank, save_fuser
from cortexstream.errors import ModelLoadError

torch = pytest.importorskip("torch")
tnn = torch.nn
pytestmark = pytest.mark.torch_ref


class TorchFFN(tnn.Module):  # reference StandardFFNLayer: pre-RMSNorm, bias-free, GELU, residual
    def __init__(self, hidden, inter):
        super().__init__()
        self.norm = tnn.RMSNorm(hidden, eps=1e-6)
        self.w1, self.w2 = tnn.Linear(hidden, inter, bias=False), tnn.Linear(inter, hidden, bias=False)
        self.act, self.drop = tnn.GELU(), tnn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.w2(self.act(self.w1(self.norm(x)))))


class TorchMLP(tnn.Module):
    def __init__(self, hidden, inter, n):
        super().__init__()
        self.blocks = tnn.ModuleList([TorchFFN(hidden, inter) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class TorchC2CProjector(tnn.Module):
    """Independent statement of thu-nics `C2CProjector` (eval path): names, shapes, concat order, gate, residual."""

    def __init__(self, source_dim, target_dim, source_num_heads, target_num_heads, intermediate_dim, hidden_dim,
                 num_layers):
        super().__init__()
        i, o = source_dim * source_num_heads, target_dim * target_num_heads
        self.ht, self.dt = target_num_heads, target_dim
        for kind in ("key", "value"):
            setattr(self, f"{kind}_in", tnn.Linear(i + o, hidden_dim))
            setattr(self, f"{kind}_mlp1", TorchMLP(hidden_dim, intermediate_dim, 1))
            setattr(self, f"{kind}_scalar_mlp2", TorchMLP(hidden_dim, hidden_dim, 1))
            setattr(self, f"{kind}_scalar_head", tnn.Linear(hidden_dim, target_num_heads))
            setattr(self, f"{kind}_proj_mlp2", TorchMLP(hidden_dim, intermediate_dim, num_layers - 2))
            setattr(self, f"{kind}_proj_out", tnn.Linear(hidden_dim, o))
            setattr(self, f"{kind}_gate_logit", tnn.Parameter(torch.randn(())))
        self.register_buffer("gate_temperature", torch.tensor(0.25))

    def one(self, kind, s, t):
        b, hs, n, ds = s.shape
        cat = torch.cat([s.transpose(1, 2).reshape(b, n, -1), t.transpose(1, 2).reshape(b, n, -1)], dim=-1)
        h = getattr(self, f"{kind}_mlp1")(getattr(self, f"{kind}_in")(cat))
        proj = getattr(self, f"{kind}_proj_out")(getattr(self, f"{kind}_proj_mlp2")(h))
        proj = proj.view(b, n, self.ht, self.dt).transpose(1, 2)
        w = getattr(self, f"{kind}_scalar_head")(getattr(self, f"{kind}_scalar_mlp2")(h)).permute(0, 2, 1).unsqueeze(-1)
        gate = (getattr(self, f"{kind}_gate_logit") > 0).float()
        return t + gate * torch.sigmoid(w) * proj

    def forward(self, source_kv, target_kv):
        return self.one("key", source_kv[0], target_kv[0]), self.one("value", source_kv[1], target_kv[1])


ARGS = dict(source_dim=8, target_dim=16, source_num_heads=4, target_num_heads=2, intermediate_dim=40,
            hidden_dim=24, num_layers=4)


def randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module.eval()


def write_thunics(directory, projectors, mapping, dtype=torch.float32):
    os.makedirs(directory, exist_ok=True)
    for i, p in enumerate(projectors):
        torch.save({k: v.to(dtype) for k, v in p.state_dict().items()}, os.path.join(directory, f"projector_{i}.pt"))
        init = dict(ARGS, dropout=0.1, initial_temperature=1.0, final_temperature=0.001, anneal_steps=1929,
                    dtype={"__type__": "torch.dtype", "value": str(dtype).split(".")[-1]})
        with open(os.path.join(directory, f"projector_{i}.json"), "w") as f:
            json.dump({"class": "C2CProjector", "init_args": init}, f)
    with open(os.path.join(directory, "projector_config.json"), "w") as f:
        json.dump({0: {1: {t: [[s, t]] for t, s in mapping.items()}}}, f)


def to_mx(t):
    return mx.array(t.detach().numpy())


def sample_kv(seed, layers, heads, dim, n=7):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, heads, n, dim, generator=gen), torch.randn(1, heads, n, dim, generator=gen))
            for _ in range(layers)]


def test_thunics_checkpoint_parity(tmp_path):
    mapping = {0: 1, 1: 2, 2: 3}  # 3 receiver layers, last-aligned onto a 4-layer sharer
    refs = [randomize(TorchC2CProjector(**ARGS), seed) for seed in range(3)]
    with torch.no_grad():
        refs[1].key_gate_logit.fill_(-1.0)  # K of layer 1 closed, V open
        refs[1].value_gate_logit.fill_(1.0)
        refs[2].key_gate_logit.fill_(2.0)
    write_thunics(str(tmp_path), refs, mapping)
    fuser = load_c2c_checkpoint(str(tmp_path), num_target_layers=3, num_source_layers=4)
    assert {t: s for t, (s, _) in fuser.layer_map.items()} == mapping
    assert fuser.projectors[0].gate_temperature == pytest.approx(0.25)
    src, tgt = sample_kv(1, 4, 4, 8), sample_kv(2, 3, 2, 16)
    fused = fuser.fused_layers([(to_mx(k), to_mx(v)) for k, v in src], [(to_mx(k), to_mx(v)) for k, v in tgt])
    with torch.no_grad():
        for t, s in mapping.items():
            want = refs[t](src[s], tgt[t])
            for got, ref in zip(fused[t], want):
                np.testing.assert_allclose(np.array(got), ref.numpy(), atol=1e-5, rtol=1e-5)
    assert fused[1][0] is not None and np.array_equal(np.array(fused[1][0]), tgt[1][0].numpy())


def test_thunics_bf16_checkpoint_loads_as_float32(tmp_path):
    ref = randomize(TorchC2CProjector(**ARGS), 5)
    with torch.no_grad():
        ref.key_gate_logit.fill_(1.0)
        ref.value_gate_logit.fill_(1.0)
    write_thunics(str(tmp_path), [ref], {0: 0}, dtype=torch.bfloat16)
    fuser = load_c2c_checkpoint(str(tmp_path))
    assert fuser.projectors[0].key_in.weight.dtype == mx.float32
    rounded = ref.to(torch.bfloat16).float()
    (sk, sv), (tk, tv) = sample_kv(3, 1, 4, 8)[0], sample_kv(4, 1, 2, 16)[0]
    got = fuser.fused_layers([(to_mx(sk), to_mx(sv))], [(to_mx(tk), to_mx(tv))])[0]
    with torch.no_grad():
        want = rounded((sk, sv), (tk, tv))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), w.numpy(), atol=1e-5, rtol=1e-5)


def test_malformed_thunics_checkpoints_raise(tmp_path):
    ref = randomize(TorchC2CProjector(**ARGS), 0)
    write_thunics(str(tmp_path / "ok"), [ref], {0: 0})
    load_c2c_checkpoint(str(tmp_path / "ok"))
    bad = tmp_path / "class"
    write_thunics(str(bad), [ref], {0: 0})
    (bad / "projector_0.json").write_text(json.dumps({"class": "AllInOneProjector", "init_args": {}}))
    with pytest.raises(ModelLoadError, match="AllInOneProjector"):
        load_c2c_checkpoint(str(bad))
    missing = tmp_path / "missing"
    write_thunics(str(missing), [ref], {0: 0})
    state = ref.state_dict()
    del state["value_proj_out.bias"]
    torch.save(state, str(missing / "projector_0.pt"))
    with pytest.raises(ModelLoadError, match="value_proj_out.bias"):
        load_c2c_checkpoint(str(missing))
    with pytest.raises(ModelLoadError, match="projector_config"):
        load_c2c_checkpoint(str(tmp_path))


class TorchLowRank(tnn.Module):
    """The seed's form: per-layer CacheProjector (k/v down/up, bias-free) and a LayerGate (sigmoid(alpha))."""

    def __init__(self, n_layers, head_dim, rank):
        super().__init__()
        self.projectors = tnn.ModuleList()
        for _ in range(n_layers):
            p = tnn.Module()
            p.k_down, p.k_up = tnn.Linear(head_dim, rank, bias=False), tnn.Linear(rank, head_dim, bias=False)
            p.v_down, p.v_up = tnn.Linear(head_dim, rank, bias=False), tnn.Linear(rank, head_dim, bias=False)
            self.projectors.append(p)
        self.gate = tnn.Module()
        self.gate.alpha = tnn.Parameter(torch.randn(n_layers))

    def forward(self, src, tgt):
        g = torch.sigmoid(self.gate.alpha)
        out = []
        for i, ((ks, vs), (kt, vt)) in enumerate(zip(src, tgt)):
            p = self.projectors[i]
            out.append(((1 - g[i]) * kt + g[i] * p.k_up(p.k_down(ks)), (1 - g[i]) * vt + g[i] * p.v_up(p.v_down(vs))))
        return out


def test_lowrank_state_dict_parity(tmp_path):
    ref = randomize(TorchLowRank(3, 16, 4), 9)
    path = str(tmp_path / "lowrank.pt")
    torch.save(ref.state_dict(), path)
    fuser = load_lowrank(path)
    assert (fuser.n_layers, fuser.head_dim, fuser.rank) == (3, 16, 4)
    src, tgt = sample_kv(1, 3, 2, 16), sample_kv(2, 3, 2, 16)
    got = fuser.fused_layers([(to_mx(k), to_mx(v)) for k, v in src], [(to_mx(k), to_mx(v)) for k, v in tgt])
    with torch.no_grad():
        want = ref(src, tgt)
    for (gk, gv), (wk, wv) in zip(got, want):
        np.testing.assert_allclose(np.array(gk), wk.numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.array(gv), wv.numpy(), atol=1e-5, rtol=1e-5)
    renamed = {k.replace("projectors.", "cache_projectors.").replace("gate.", "layer_gate."): v
               for k, v in ref.state_dict().items()}
    torch.save(renamed, str(tmp_path / "alias.pt"))
    assert mx.array_equal(load_lowrank(str(tmp_path / "alias.pt")).gate.alpha, fuser.gate.alpha)
    torch.save({"something": torch.zeros(3)}, str(tmp_path / "junk.pt"))
    with pytest.raises(ModelLoadError):
        load_lowrank(str(tmp_path / "junk.pt"))


def test_safetensors_roundtrip(tmp_path):
    lowrank = C2CFuser(n_layers=2, head_dim=16, rank=4)
    lowrank.gate.alpha = mx.array([0.3, -1.2])
    projector = C2CProjectorFuser.create(source_layers=3, target_layers=2, source_heads=4, source_head_dim=8,
                                         target_heads=2, target_head_dim=16, hidden_dim=24, intermediate_dim=40,
                                         num_layers=4)
    projector.projectors[0].key_gate_logit = mx.array(0.7)
    projector.projectors[1].update_temperature(500)
    src3, src2, tgt = sample_kv(1, 3, 4, 8), sample_kv(3, 2, 2, 16), sample_kv(2, 2, 2, 16)
    for fuser, src in ((lowrank, src2), (projector, src3)):
        path = str(tmp_path / f"{type(fuser).__name__}.safetensors")
        save_fuser(fuser, path)
        back = load_fuser(path)
        assert type(back) is type(fuser)
        from mlx.utils import tree_flatten
        a, b = dict(tree_flatten(fuser.parameters())), dict(tree_flatten(back.parameters()))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
        args = ([(to_mx(k), to_mx(v)) for k, v in src], [(to_mx(k), to_mx(v)) for k, v in tgt])
        for (x, y), (z, w) in zip(fuser.fused_layers(*args), back.fused_layers(*args)):
            assert mx.array_equal(x, z) and mx.array_equal(y, w)
    assert back.layer_map == projector.layer_map
    assert back.projectors[1].gate_temperature == pytest.approx(projector.projectors[1].gate_temperature)
    with pytest.raises(ModelLoadError):
        save_fuser(lowrank, str(tmp_path / "x.pt"))

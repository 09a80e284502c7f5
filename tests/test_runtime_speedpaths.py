"""The runtime's fast paths give what the plain paths give: one mapping per run of a
unit's tensors (vs one ``get`` per tensor), routed experts used in place, inline
loading of units that need no compute, the cheap finite check, and MLA's values laid
out for sdpa's fused kernel."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
import torch.nn.functional as F

from k3convert.checkpoint import open_checkpoint
from k3convert.errors import NonFiniteError
from k3convert.runtime import Runtime
from k3convert.runtime import source as source_mod
from k3convert.runtime.decoder import _flash_values
from k3convert.runtime.runtime import _finite
from k3convert.runtime.source import Lazy, map_runs, plain_runs
from tests.test_runtime import batch


class PassThrough:
    """A checkpoint behind another type: the runtime must take its ``get`` path."""

    def __init__(self, ck):
        self.ck, self.config = ck, ck.config

    def names(self):
        return self.ck.names()

    def meta(self, name):
        return self.ck.meta(name)

    def get(self, name, dtype=None):
        return self.ck.get(name, dtype)


@pytest.fixture(scope="module")
def bf16_deepseek(model_factory):
    return model_factory("deepseek_v3", dtype=torch.bfloat16)


@pytest.mark.parametrize("gap", [None, -1])
@pytest.mark.parametrize("which", ["deepseek_v3", "llama", "bf16"])
def test_mapped_views_are_the_tensors_get_returns(which, gap, tiny_models, bf16_deepseek,
                                                  monkeypatch):  # fmt: skip
    path = bf16_deepseek if which == "bf16" else tiny_models[which]
    if gap is not None:  # every tensor its own run
        monkeypatch.setattr(source_mod, "RUN_GAP", gap)
    ck = open_checkpoint(path)
    names = ck.names()
    runs = plain_runs(ck, names)
    got = map_runs(runs, advise=True)
    assert set(got) == set(names)
    if gap is not None:
        assert len(runs) == len(names)
    for n in names:
        ref = ck.get(n)
        t = got[n]
        assert t.dtype == ref.dtype and t.shape == ref.shape and t.is_contiguous()
        assert torch.equal(t, ref), n
    assert plain_runs(PassThrough(ck), names) == []  # only the Checkpoint type itself


def test_plain_experts_in_place_converted_ones_lazy(tiny_models, bf16_deepseek):
    with Runtime(open_checkpoint(tiny_models["deepseek_v3"])) as rt:
        w = rt.loader.get("layer.1")
        experts = [k for k in w if k.startswith("routed_experts.")]
        assert experts and not any(isinstance(dict.__getitem__(w, k), Lazy) for k in experts)
    ck = open_checkpoint(bf16_deepseek)
    with Runtime(ck) as rt:  # bf16 stored, fp32 compute: converted on use, one at a time
        w = rt.loader.get("layer.1")
        experts = [k for k in w if k.startswith("routed_experts.")]
        assert all(isinstance(dict.__getitem__(w, k), Lazy) for k in experts)
        a, b = w[experts[0]], w[experts[0]]
        assert a is not b and a.dtype == torch.float32
        assert torch.equal(a, ck.get(w.names[experts[0]]).float())
        assert w.get("attention.o_proj").dtype == torch.float32  # converted at load
    with Runtime(PassThrough(open_checkpoint(tiny_models["deepseek_v3"]))) as rt:
        w = rt.loader.get("layer.1")
        assert all(isinstance(dict.__getitem__(w, k), Lazy) for k in w if "routed_" in k)


@pytest.mark.parametrize("which", ["deepseek_v3", "qwen3_moe", "bf16"])
def test_fast_paths_give_the_plain_paths_logits(which, tiny_models, bf16_deepseek):
    path = bf16_deepseek if which == "bf16" else tiny_models[which]
    ids, mask = batch()
    outs = {}
    for label, make in {
        "streamed": lambda: Runtime(open_checkpoint(path)),
        "resident": lambda: Runtime(open_checkpoint(path), resident=True),
        "no prefetch": lambda: Runtime(open_checkpoint(path), prefetch=False),
        "get path": lambda: Runtime(PassThrough(open_checkpoint(path))),
    }.items():
        with make() as rt:
            outs[label] = rt.forward(ids, attention_mask=mask)
            if label == "resident":  # kept units, experts in place: the same again
                assert torch.equal(rt.forward(ids, attention_mask=mask), outs[label])
    for label, out in outs.items():
        assert torch.equal(out, outs["get path"]), label


def test_cheap_units_load_inline_two_alive_at_most(tiny_models, monkeypatch):
    alive, peak, threads = [0], [0], []
    orig = source_mod.UnitLoader._load

    def gone():
        alive[0] -= 1

    def load(self, unit, *args):
        w = orig(self, unit, *args)
        threads.append(threading.current_thread().name)
        alive[0] += 1
        weakref.finalize(w, gone)
        peak[0] = max(peak[0], alive[0])
        return w

    monkeypatch.setattr(source_mod.UnitLoader, "_load", load)
    ids, mask = batch()
    with Runtime(open_checkpoint(tiny_models["deepseek_v3"])) as rt:
        assert all(rt.loader._runs_of(u)[1] for u in rt.plan.order)  # all mapped in place
        rt.forward(ids, attention_mask=mask)
        n = len(rt.plan.order)
        assert rt.loader.loads == n and peak[0] <= 2
        rt.forward(ids, attention_mask=mask)
        assert rt.loader.loads == 2 * n  # streamed again
    assert alive[0] == 0
    assert not any(t.startswith("k3-prefetch") for t in threads)  # nothing to offload


def test_finite_check_is_exact():
    _finite(torch.full((4, 8), 3e38), "big", "u")  # the sum overflows, the values do not
    _finite(torch.full((4, 8), 3e38, dtype=torch.bfloat16), "big", "u")
    _finite(torch.zeros(0), "empty", "u")
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = torch.ones(3, 5, dtype=dtype)
            t[1, 2] = bad
            with pytest.raises(NonFiniteError, match="layer 3"):
                _finite(t, "layer 3's output", "layer.3")
    t = torch.ones(6)
    t[0], t[1] = float("inf"), -float("inf")
    with pytest.raises(NonFiniteError):
        _finite(t, "x", "u")


@pytest.mark.parametrize("dims", [(64, 32, 64), (32, 16, 16), (16, 16, 32)])
@pytest.mark.parametrize("masked", [False, True])
def test_flash_values_layouts_agree(dims, masked):
    nope, rope, dv = dims
    dq = nope + rope
    g = torch.Generator().manual_seed(0)
    b, nh, s = 2, 3, 9
    kv = torch.randn(b, s, nh, nope + dv, generator=g).transpose(1, 2)
    v = kv[..., nope:]
    q = torch.randn(b, nh, s, dq, generator=g)
    k = torch.randn(b, nh, s, dq, generator=g)
    mask = None
    if masked:
        mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
        mask[1, :, :, :2] = False
        mask |= ~mask.any(-1, keepdim=True)

    def attend(vals, cols):
        o = F.scaled_dot_product_attention(
            q, k, vals, attn_mask=mask, is_causal=mask is None, scale=dq**-0.5
        )
        return o if cols is None else o[..., cols]

    ref = attend(v, None)  # the unfused kernel when dv != dq
    view = attend(*_flash_values(v, kv, dq))
    padded = attend(*_flash_values(v, None, dq))
    assert torch.equal(view, padded)
    assert torch.allclose(view, ref, rtol=0, atol=1e-5)
    vals, cols = _flash_values(v, kv, dq)
    if dv <= dq:
        assert vals.shape[-1] == dq and vals.data_ptr() >= kv.data_ptr()  # a view
    else:
        assert cols is None and vals is v


def test_fused_mla_off_under_activation_quantization(quant_sources, tmp_path):
    from k3convert.pipeline.quantize import quantize

    out = tmp_path / "fp8"
    quantize(src=quant_sources["deepseek_v3"], out=out, scheme="fp8-dynamic", progress=False)
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)[None]
    with Runtime(open_checkpoint(out)) as rt:
        h = rt.embed(ids)
        assert rt.act_quant and not rt._step_for(pos, None, h).fused_mla
        rt.act_quant = False
        assert rt._step_for(pos, None, h).fused_mla  # rebuilt, not the cached step
    with Runtime(open_checkpoint(quant_sources["deepseek_v3"])) as rt:
        assert rt._step_for(pos, None, rt.embed(ids)).fused_mla

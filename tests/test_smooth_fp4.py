"""Smoothing's searches with NVFP4 (W4A4): what each candidate is scored with.

- the activation spec a search fake-quantizes a Linear's smoothed input with: NVFP4's
  under the input global scale calibration stores for that input, compressed-tensors'
  ``generate_gparam`` of its largest |x|;
- a fused set's largest |value| under a candidate smoothing (its shared global scale),
  from the members' column maxima: equal, bit for bit, to the maximum of the smoothed
  weights themselves;
- SmoothQuant's margin (``sq_min_gain``): an input with outlier channels is smoothed
  under NVFP4 activations; a margin the gain does not reach leaves it alone.
"""

from __future__ import annotations

import pytest
import torch

from k3convert.calibrate.smooth import (
    Mapping,
    Statistics,
    _SetMax,
    search_activation,
    smoothquant_search,
)
from k3convert.quant.activations import nv_input_global_scale
from k3convert.quant.schemes import get_scheme


def _gparam(amax: float) -> float:
    from compressed_tensors.quantization.utils import generate_gparam

    a = torch.tensor([amax])
    return float(generate_gparam(-a, a))


def test_nvfp4_search_activation_takes_calibrations_global_scale():
    x = torch.randn(64, 32) * 3
    spec = search_activation(get_scheme("nvfp4"), x, plain=False)
    assert spec.strategy == "tensor_group" and spec.global_scale.shape == (1,)
    assert float(spec.global_scale) == _gparam(float(x.abs().max()))
    assert float(spec.global_scale) == nv_input_global_scale(float(x.abs().max()))
    assert search_activation(get_scheme("nvfp4"), x, plain=True) is None  # routed experts
    assert search_activation(get_scheme("nvfp4a16"), x, plain=False) is None
    assert search_activation(get_scheme("w8a8"), x, plain=False) is get_scheme("w8a8").act
    assert search_activation(get_scheme("fp8"), x, plain=False) is None  # static: weights
    assert search_activation(get_scheme("nvfp4"), torch.zeros(4, 32), plain=False) is None


def test_fused_set_max_under_a_smoothing_is_the_smoothed_weights_max():
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(48, 64, generator=g) for n in ("gate", "up", "other")}
    m = Mapping(label="t", prev="norm", prev_is_norm=True, balance=("gate", "up"))
    sets = {"gate": ("gate", "up"), "up": ("gate", "up")}
    sm = _SetMax(m, w.__getitem__, lambda n: sets.get(n, ()))
    for _ in range(5):
        s = torch.rand(64, generator=g) * 4 + 0.05
        want = torch.stack([(w[k] * s).abs().amax() for k in ("gate", "up")]).amax()
        assert torch.equal(sm("gate", s), want) and torch.equal(sm("up", s), want)
    assert _SetMax(m, w.__getitem__, None)("gate", s) is None
    # a member outside the mapping keeps its own maximum
    m2 = Mapping(label="t", prev="norm", prev_is_norm=True, balance=("gate",))
    sm2 = _SetMax(m2, w.__getitem__, lambda n: ("gate", "other"))
    want = torch.maximum((w["gate"] * s).abs().amax(), w["other"].abs().amax())
    assert torch.equal(sm2("gate", s), want)


@pytest.mark.parametrize(("min_gain", "smoothed"), [(0.25, True), (0.999, False)])
def test_smoothquant_moves_outlier_channels_under_nvfp4(min_gain, smoothed):
    """Inputs with a few channels 50x larger: under NVFP4 activations their groups'
    scales flatten the other channels; smoothing takes them into the weights."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    x[:, [3, 17, 40]] *= 50
    w = {"q": torch.randn(32, 64, generator=g) * 0.05, "k": torch.randn(32, 64, generator=g) * 0.05}
    stats = Statistics(cap=256, batches=1)
    stats.add("q", x, sample=True)
    m = Mapping(label="attn", prev="norm", prev_is_norm=True, balance=("q", "k"), source="q")
    sets = {"q": ("q", "k"), "k": ("q", "k")}
    s, alpha = smoothquant_search(m, w.__getitem__, lambda n: get_scheme("nvfp4"), stats,
                                  set_of=lambda n: sets.get(n, ()),
                                  min_gain=min_gain)  # fmt: skip
    if smoothed:
        assert alpha is not None and float(s[[3, 17, 40]].min()) > float(s.median())
    else:
        assert alpha is None and torch.equal(s, torch.ones(64))

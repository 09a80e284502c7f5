"""A trained fixture with outlier channels: the same function, bit for bit, with a few
residual-stream channels made large where RMSNorms hand them to Linears.

Trained LLMs of a few billion parameters and up carry *outlier features*: a handful of
hidden channels whose activations are tens of times larger than the rest, consistently
across tokens (Dettmers et al., LLM.int8(), https://arxiv.org/abs/2208.07339; Xiao et
al., SmoothQuant, https://arxiv.org/abs/2211.10438). They are what makes per-token W8A8
activation quantization lose precision: one large channel sets the token's scale. The
4-layer fixtures of :mod:`tests.trained` are too small and too briefly trained to grow
them, so SmoothQuant has little to move there.

:func:`with_outlier_channels` builds that structure into a copy of a fixture without
changing what it computes: an RMSNorm's weight is multiplied by ``factor`` on
``channels`` and every Linear reading that norm's output has the same columns divided by
``factor``. ``factor`` is a power of two, so both products are exact in bfloat16 and the
float32 forward gives the same logits bit for bit (checked with transformers' own model
in tests/test_calibrate_quality.py); only the activations between the norm and its
readers change. The readers are named here from the Hugging Face layouts the fixtures
use (not from k3convert's own smoothing mappings, which are what the tests judge):
``input_layernorm`` feeds the attention projections, ``post_attention_layernorm`` the
dense MLP or the MoE block's router, shared experts and every routed expert.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: channels of the 128-wide fixtures made large (~3 % of them, spread over the width)
CHANNELS = (5, 37, 70, 101)
#: how much larger (a power of two: the transform stays exact in bfloat16)
FACTOR = 32.0

_NORM = re.compile(r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")
_READERS = {
    "input_layernorm": re.compile(
        r"\.self_attn\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)\.weight$"
    ),
    "post_attention_layernorm": re.compile(
        r"\.mlp\.(gate_proj|up_proj|gate|shared_experts\.(gate_proj|up_proj)"
        r"|experts\.\d+\.(gate_proj|up_proj))\.weight$"
    ),
}


def with_outlier_channels(
    src: Path,
    out: Path,
    *,
    norms: str = r".",
    channels=CHANNELS,
    factor: float = FACTOR,
) -> Path:
    """A copy of the model directory ``src`` at ``out`` (created; it must not exist) with
    ``channels`` of every norm whose weight name matches ``norms`` (a regex) ``factor``
    times larger and those columns of the norm's readers ``factor`` times smaller.
    Returns ``out``. Raises ValueError if a chosen norm has no reader (a layout this
    module does not know) or ``factor`` is not a power of two."""
    mant, _ = torch.frexp(torch.tensor(float(factor)))
    if factor <= 0 or float(mant) != 0.5:
        raise ValueError(f"factor {factor} is not a power of two: the copy would not be exact")
    out = Path(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    files = sorted(Path(src).glob("*.safetensors"))
    tensors = {p.name: load_file(p) for p in files}
    where = {k: f for f, sd in tensors.items() for k in sd}
    idx = torch.tensor(list(channels))
    changed: list[str] = []
    for name in sorted(where):
        m = _NORM.match(name)
        if not m or not re.search(norms, name):
            continue
        layer, kind = m.groups()
        readers = [
            k for k in where
            if k.startswith(f"model.layers.{layer}.") and _READERS[kind].search(k)
        ]  # fmt: skip
        if not readers:
            raise ValueError(f"{src}: no reader of {name} found; unknown layout")
        sd = tensors[where[name]]
        sd[name] = _scaled(sd[name], idx, factor, rows=True)
        for r in readers:
            t = tensors[where[r]]
            t[r] = _scaled(t[r], idx, 1.0 / factor, rows=False)
        changed.append(name)
    if not changed:
        raise ValueError(f"{src}: no norm weight matches {norms!r}")
    for f, sd in tensors.items():
        save_file(sd, out / f, metadata={"format": "pt"})
    note = {"norms": changed, "channels": list(channels), "factor": factor, "source": str(src)}
    (out / "outliers.json").write_text(json.dumps(note, indent=1) + "\n")
    return out


def _scaled(t: torch.Tensor, idx: torch.Tensor, f: float, *, rows: bool) -> torch.Tensor:
    """``t`` with entries ``idx`` (a norm weight) or columns ``idx`` (a Linear) times
    ``f``, in ``t``'s dtype (exact: ``f`` is a power of two)."""
    x = t.clone()
    if rows:
        x[idx] = (x[idx].float() * f).to(t.dtype)
    else:
        x[:, idx] = (x[:, idx].float() * f).to(t.dtype)
    return x

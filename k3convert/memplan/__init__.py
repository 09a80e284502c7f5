"""``k3convert plan``: device memory per rank for a parallel layout and a serving workload.

Modules: :mod:`.devices` (budgets), :mod:`.tensors` (what a source stores or would
store), :mod:`.weights` (weights per rank), :mod:`.workload` (KV cache, KDA state,
activations), :mod:`.search` (the smallest layouts that fit), :mod:`.render` (the result
and its table / JSON / chart), :mod:`.plan` (:func:`plan_memory`, which composes them).

Needs no weights: a config.json (or a bundled preset) is enough; a model directory's own
stored tensors are used when it has them. Four components per rank, all in bytes:

**Weights** - exactly what ``shard`` would write to that rank: the tensor bytes of its
units (no file header or 4096-byte alignment padding; a vocab-parallel piece includes its
zero rows). The tensors come from the checkpoint, or for a config alone from what
``synth`` would write for it (the config dtype; its ``quantization_config``'s encodings:
Kimi K3's routed experts MXFP4 as released, DeepSeek-V3 / Kimi-K2 FP8 blocks). With
``--scheme`` or a recipe's ``quantize`` section the tensors are first resolved as
``quantize`` would write them (:func:`k3convert.quant.rules.resolve`, each row's stored
parts), then cut by the shard planner's own split rules (``shard.plan.Splitter``),
pipeline partition (``partition_layers``) and expert placement (``place_experts``, with
``--redundant-experts``; without ``--expert-load`` the copies go to the lowest-numbered
experts, which changes nothing when every expert has the same size). The sums are
grouped by tensor signature so that a layout costs milliseconds; the tests check them
against ``build_plan`` and against a written shard manifest, byte for byte.

**KV cache** (exact; ``tokens`` = ``--context``, ``B`` = ``--batch``, ``b`` = bytes of
``--kv-dtype``) per rank, over the decoder layers of its pipeline stage (MTP layers'
caches are not counted):

- GQA layer: ``2 * kv_local * head_dim * tokens * B * b``; ``kv_local = kv_heads / tp``,
  or 1 when ``tp > kv_heads`` (each rank holds one replicated KV head group).
- MLA layer: ``(kv_lora_rank + qk_rope_head_dim) * tokens * B * b``: the compressed
  latent cache serving engines keep (DeepSeek's absorbed scheme); it is replicated on
  every TP rank of the stage, so it does not shrink with tp.
- KDA layer (Kimi-Linear / Kimi K3): no per-token cache; a fixed state per sequence that
  does not grow with the context: ``B * (H_local * D * D * 4 + 3 * H_local * D * (K - 1)
  * a)`` with ``H_local = kda_heads / tp``, D the KDA head dim, K the short-conv kernel:
  the float32 recurrent state and the last ``K - 1`` inputs of the q / k / v short
  convolutions. Those are in the projection outputs' dtype (``runtime/kda.py``:
  ``KDAState``), the activation dtype ``a`` = bf16 (2 bytes); ``--kv-dtype`` changes
  neither (the runtime keeps KDA states in float32 whatever the cache dtype is).

**Activations** - an ESTIMATE, not a measurement: the peak of one decoder layer's
working set while prefilling a chunk of ``T = min(--prefill-chunk, B * tokens)`` tokens,
in bf16 (``a = 2``) unless noted, per rank (widths divided by tp as the rank holds them):

- residual stream: ``3 * T * hidden * a`` (hidden state, normed input, the block's
  partial output before its all-reduce);
- attention block: GQA ``T * a * (2 * H_local * d + 2 * kv_local * d)`` (q, output, k, v;
  flash attention keeps no score matrix); MLA ``T * a * (q_lora + kv_lora + rope +
  H_local * (2 * qk_head + 2 * v_head))`` (compressed q / kv, q, the chunk's expanded k
  and v, the output); KDA ``T * H_local * D * (4 * a + 5 * 4)`` (q / k / v / output-gate
  projections, and q, k, v, decay and output in float32 as the kernel computes them);
- MLP block: dense ``3 * T * I_local * a`` (gate, up, their product); MoE: the token
  copies an EP rank's experts receive under balanced routing, ``S = ceil(T * top_k /
  ep)``, each with its dispatched input and output (``2 * h_e``) and the expert's gate /
  up / product (``3 * I_e / moe_tp``): ``S * a * (2 * h_e + 3 * I_e / moe_tp)``, plus
  the router's float32 logits ``T * E * 4``, the shared experts ``3 * T * a * n_shared *
  I_e / tp`` and, for a latent MoE, ``2 * T * h_e * a`` (h_e: the routed experts' width);
- a layer's peak: residual + max(attention block, MLP block); a stage's: the largest of
  its layers, plus on the last stage the float32 logits of the chunk's last token per
  sequence after the vocab-parallel head's all-gather, ``B * vocab * 4``.

It leaves out the serving engine's own reservations (CUDA graphs, allocator slack,
communication buffers), hot-expert imbalance, the vision tower's activations and
sliding-window caps (every layer caches the full context).

**Budget**: ``--device-mem`` (``141GB``, ``140GiB``, ``1.5TB``: GB = 10^9, GiB = 2^30
bytes) or ``--device NAME``, a published capacity (:data:`DEVICES`, decimal GB as the
vendors state them). Ranks over budget are flagged; the smallest layouts that fit are
searched (tp among the degrees the model's heads allow, ep dividing tp and the expert
slots, pp up to the layer count), ranked by device count then peak rank memory.
Exit codes (CLI): 0 whether or not it fits (the FLAG column says OVER), 1 with
``--fail-if-over`` when a rank is over budget, 2 for bad input.
"""

from .devices import DEVICES, device_budget
from .plan import load_source, plan_memory
from .render import COMPONENTS, FORMAT, LayoutFit, MemoryPlan, RankMemory, plot_plan
from .search import Planner
from .tensors import Tensors, checkpoint_tensors, config_tensors, quantized_tensors
from .weights import WeightModel, build_plan_bytes
from .workload import KV_DTYPES, LayerModel, Workload

__all__ = [
    "COMPONENTS",
    "DEVICES",
    "FORMAT",
    "KV_DTYPES",
    "LayerModel",
    "LayoutFit",
    "MemoryPlan",
    "Planner",
    "RankMemory",
    "Tensors",
    "WeightModel",
    "Workload",
    "build_plan_bytes",
    "checkpoint_tensors",
    "config_tensors",
    "device_budget",
    "load_source",
    "plan_memory",
    "plot_plan",
    "quantized_tensors",
]

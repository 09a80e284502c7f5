"""The runtime over every rank of a layout: tensor, expert and pipeline parallel.

Each rank computes with only what it holds (its units, its slices, its experts), and the
ranks combine as a serving engine's do, through :class:`Collectives`:

- a decoder layer is two phases, attention then MLP / MoE; in each, every rank of the
  stage's tensor-parallel group computes its *partial* output (column-split linears run
  locally; the row-split o_proj / down_proj give partial sums, their bias added by the
  rank holding the first slice only) and one all-reduce (gather + sum in rank order)
  completes it, then the residual is added;
- vocab-parallel embedding: each rank looks up the ids inside its rows, zeros for the
  rest, all-reduce; vocab-parallel lm_head: all-gather, concatenate, trim the padding;
- experts: a rank runs only the routed experts it holds; an expert held by several EP
  ranks (redundant copies) serves token ``t`` from copy ``t mod copies`` (the copy list
  of the manifest, in order), so each (token, choice) slot is computed exactly once; the
  MoE output joins the TP all-reduce (DeepSeek's reference scheme). Routers are
  replicated, so every rank routes identically;
- pipeline stages hand the hidden state on in order (rank ``(s, t)`` to ``(s+1, t)``);
  the first stage holds embed and vision, the last holds the head, whose logits are
  broadcast to every process.

Simulated (default), ranks run one at a time in this process, and each phase loads only
the part of one rank's unit it needs (attention or MLP), so peak memory stays near one
rank's layer; routed experts are dequantized when they run, one at a time. Under
torchrun each process runs its own rank and the same code exchanges real tensors.

Activation fake-quantization (quantized candidates) sees each rank's local input, as
serving kernels do: a row-parallel Linear's per-token scale is taken over its slice.

Hybrid models (kimi_linear, Kimi K3): KDA layers split by heads like attention (each
rank runs its heads' projections, convolutions, gates and recurrent state; o_proj is
row-parallel), so they need nothing but their own phase components. A *latent* MoE
(K3) reduces twice: the routed experts' weighted latent sum (partial per EP rank and
moe_tp slice) is all-reduced before ``routed_expert_norm`` (not linear), then
``routed_expert_up_proj`` (replicated) runs on the complete sum, and the shared experts'
partial outputs join a second all-reduce. Attention residuals (K3): the mixing vectors
are replicated and the mix is computed once per process from the first local rank's
copy; the state (:class:`~k3convert.runtime.decoder.AttnResState`) passes between
pipeline stages packed into one tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError
from ..parallel.collectives import Collectives, SimulatedCollectives
from .decoder import (
    AttnResState,
    attention_block,
    blocks_before,
    gated_mlp,
    latent_finish,
    latent_routed,
    layer_output,
    mlp_block,
    res_post_attention,
    res_pre_attention,
)
from .ops import rms_norm
from .ranks import RankSet
from .runtime import Runtime, _finite, check_vocab
from .source import Lazy, Plan, Weights, activation_params, to_compute

#: components a phase loads (unit keys are ``component.kind``)
ATTENTION_PHASE = ("attention", "linear_attention", "norms", "attn_res")
MLP_PHASE = ("norms", "dense_mlp", "shared_experts", "routed_experts", "router", "latent",
             "attn_res")  # fmt: skip


class RankLoader:
    """One rank's units as :class:`Weights`, keyed like the unsharded runtime's, with
    each tensor's manifest entry in ``Weights.splits``. Nothing is kept between calls:
    the stream reader keeps the unit's mapping, :meth:`release` drops it."""

    def __init__(
        self, reader, plan: Plan, *, dtype, device, input_scales: frozenset[str],
        resident: bool = False,
    ):  # fmt: skip
        self.reader, self.plan = reader, plan
        #: resident: every phase's weights kept once loaded, experts included (decoding a
        #: small model fast); None streams
        self._kept: dict | None = {} if resident else None
        self.dtype, self.device = dtype, device
        self.input_scales = input_scales
        # (unit, global name) -> local logical name; the tied lm_head is its own copy
        self._local: dict[tuple[str, str], str] = {}
        self._entry: dict[str, dict] = {}
        for u in reader.unit_entries:
            for e in u["tensors"]:
                glob = e.get("tied_to") or e["logical"]
                self._local[(u["name"], glob)] = e["logical"]
                if e["part"] in ("weight", "weight_packed"):
                    self._entry[e["logical"]] = e

    def get(self, unit: str, components: tuple[str, ...] | None = None) -> Weights:
        if self._kept is not None:
            key = (unit, components)
            if key not in self._kept:
                w = self._get(unit, components)
                for k in list(w):
                    w[k] = w[k]  # make Lazy entries now, once
                self._kept[key] = w
            return self._kept[key]
        return self._get(unit, components)

    def _get(self, unit: str, components: tuple[str, ...] | None) -> Weights:
        entries = self.plan.units.get(unit, {})
        tensors: dict = {}
        names: dict[str, str] = {}
        splits: dict[str, dict] = {}
        for key, e in entries.items():
            if components is not None and key.split(".", 1)[0] not in components:
                continue
            local = self._local.get((unit, e.name))
            if local is None:
                continue
            names[key] = e.name
            splits[key] = self._entry.get(local, {})
        for key in list(names):
            if key.endswith("_bias") and self._drop_bias(splits.get(key[: -len("_bias")])):
                del names[key], splits[key]  # row-parallel: the first slice's rank adds it
                continue
            local = self._local[(unit, entries[key].name)]
            if entries[key].role.expert is not None:
                tensors[key] = Lazy(functools.partial(self._tensor, key, local))
            else:
                tensors[key] = self._tensor(key, local)
            if entries[key].name in self.input_scales:
                parts = self.reader.get_parts(local)
                tensors.update(activation_params(parts, key, self.dtype, self.device))
        return Weights(unit, tensors, names, splits)

    @staticmethod
    def _drop_bias(e: dict | None) -> bool:
        return bool(e) and e.get("split_dim") == 1 and e.get("offset", 0) != 0

    def _tensor(self, key: str, local: str) -> torch.Tensor:
        return to_compute(self.reader.get(local, None), key, local, self.dtype, self.device, False)

    def release(self) -> None:
        if self._kept is None:
            self.reader.release()

    def close(self) -> None:
        self._kept = {} if self._kept is not None else None
        self.reader.release()


class ParallelRuntime(Runtime):
    """:class:`Runtime`'s interface (``forward``, ``embed``, ``run_layer``, ``head``)
    over a :class:`RankSet`; see the module docstring.

    On a process that does not run the stage a piece belongs to (torchrun, pp > 1) the
    hidden state is ``None``; ``forward`` returns the logits on every process.
    resident: keep every rank's weights (experts dequantized) once loaded, for fast
    repeated forwards / decoding of a model that fits in memory; default streams.
    """

    def __init__(
        self,
        ranks: RankSet,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        *,
        collectives: Collectives | None = None,
        act_quant: bool | None = None,
        act_quant_experts: bool = False,
        resident: bool = False,
    ):
        self.ranks = ranks
        self._setup(ranks.view, device, dtype, act_quant, act_quant_experts)
        self.layout = ranks.layout
        self.coll = collectives or SimulatedCollectives(ranks.world)
        if self.coll.world != ranks.world:
            raise ConfigError(
                f"the collectives span {self.coll.world} ranks but the layout has {ranks.world}."
            )
        self.loaders = {
            r: RankLoader(
                ranks.rank(r), self.plan, dtype=self.dtype, device=self.device,
                input_scales=self._static, resident=resident,
            )
            for r in range(ranks.world)
            if self.coll.runs(r)
        }  # fmt: skip
        #: unit name -> the pipeline stage that runs it
        self.stage_of = {u: s.pp_rank for s in ranks.stages for u in s.units}
        for u in self.plan.order:
            if u not in self.stage_of:
                raise CheckpointError(f"{ranks.where}: no pipeline stage holds unit '{u}'.")
        if self.act_quant:
            self._check_local_groups()
        self.vocab = self.ranks.view.meta(
            self.plan.units["embed"]["embeddings.embed_tokens"].name
        ).shape[0]
        self._slot_tables: dict[int, tuple | None] = {}
        self._stage = 0  # stage the hidden state is on during a forward

    def _check_local_groups(self) -> None:
        """Group-wise activation quantization of a row-parallel Linear sees the rank's
        input slice: each slice must hold whole groups (serving kernels need it too)."""
        for r in self.ranks.readers.values():
            for u in r.unit_entries:
                for e in u["tensors"]:
                    spec = self.act_specs.get(e["logical"])
                    if spec is None or spec.strategy != "group" or e.get("split_dim") != 1:
                        continue
                    if e["part"] == "weight":
                        width = e["shape"][1]
                    elif e["part"] == "weight_packed":
                        width = e["shape"][1] * 32 // int((e.get("quant") or {})["num_bits"])
                    else:
                        continue
                    if width % spec.group_size:
                        raise ConfigError(
                            f"{self.ranks.where}: layout tp={self.layout.tp} cuts the input of "
                            f"'{e['logical']}' ({e['logical_shape'][1]} wide) into {width}-wide "
                            f"slices, which do not hold whole {spec.group_size}-channel "
                            f"activation groups; a serving engine cannot run this layout either. "
                            f"Use a smaller tp, or quantize these Linears' activations per "
                            f"token (e.g. fp8-dynamic) for this layout."
                        )

    # -- forward: Runtime.forward, with these three pieces ------------------------------
    def _check_finite(self, t: torch.Tensor | None, what: str, unit: str) -> None:
        """The runtime's NaN / inf check, agreed by every process (under torchrun only
        the processes of one stage hold ``t``; all must stop, not wait for them)."""
        bad = t is not None and not bool(torch.isfinite(t).all())
        if any(self.coll.flags(bad)):
            _finite(torch.tensor(float("nan")), what, unit)

    def _observed(self, i: int, h) -> torch.Tensor | None:
        return self._to_rank0(layer_output(h), self.stage_of[f"layer.{i}"])

    def _release_units(self) -> None:
        for ld in self.loaders.values():
            ld.release()

    def _group(self, unit: str) -> tuple[tuple[int, ...], list[int]]:
        g = self.ranks.tp_group(self.stage_of[unit])
        return g, self.coll.local(g)

    def _handoff(self, h, stage: int, layer: int | None = None):
        """Move the hidden state from the current stage to ``stage`` (rank (s, t) sends
        to (s', t)); processes outside ``stage`` end with None. With attention residuals
        the state entering ``layer`` (None: the head) goes packed as one tensor."""
        if stage == self._stage:
            return h
        shape, packed = self._shape, None
        if self.text.attn_res_block is not None:
            packed = blocks_before(self.text, self.num_layers if layer is None else layer) + 1
            shape = (packed, *shape)
        src_g, dst_g = self.ranks.tp_group(self._stage), self.ranks.tp_group(stage)
        out = None
        for src, dst in zip(src_g, dst_g, strict=True):
            a, b = self.coll.runs(src), self.coll.runs(dst)
            if a and b:
                out = h
            elif a:
                self.coll.send(h.pack() if isinstance(h, AttnResState) else h, src, dst)
            elif b:
                out = self.coll.recv(src, dst, shape, self.dtype)
                if packed is not None and out.shape[0] == packed and out.ndim == 4:
                    out = AttnResState.unpack(out)
        self._stage = stage
        return out

    def _to_rank0(self, h: torch.Tensor | None, stage: int) -> torch.Tensor | None:
        """The hidden state on the process running rank 0 (for per-layer reports)."""
        owner = self.ranks.tp_group(stage)[0]
        if self.coll.runs(owner) and self.coll.runs(0):
            return h
        if self.coll.runs(owner):
            self.coll.send(h, owner, 0)
            return None
        if self.coll.runs(0):
            return self.coll.recv(owner, 0, self._shape, self.dtype)
        return None

    # -- embed / vision -----------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, input_ids, pixel_values=None, image_grid_thw=None):
        ids = self._ids(input_ids)
        if pixel_values is not None and self._widens:
            ids, _ = self.expand_media(ids, image_grid_thw)  # (the embeddings are wider)
        self._stage = 0  # the hidden state starts on the first stage
        self._shape = (*ids.shape, self.text.hidden_size)
        _, local = self._group("embed")
        if not local:
            return None
        return super().embed(ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw)

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        check_vocab(ids, self.vocab)
        group, local = self._group("embed")
        parts = {}
        for r in local:
            w = self.loaders[r].get("embed")
            table = w.need("embeddings.embed_tokens")
            sp = w.splits.get("embeddings.embed_tokens", {})
            if sp.get("split_dim") == 0:
                rows = table.shape[0] - sp["pad"]
                loc = ids - sp["offset"]
                inside = (loc >= 0) & (loc < rows)
                e = F.embedding(loc.clamp(0, max(rows - 1, 0)).to(table.device), table)
                parts[r] = e.to(self.dtype).masked_fill(~inside[..., None].to(e.device), 0)
            elif r == group[0]:
                parts[r] = F.embedding(ids.to(table.device), table).to(self.dtype)
            else:  # a replicated table: the group's first rank contributes it
                parts[r] = torch.zeros(
                    (*ids.shape, table.shape[1]), dtype=self.dtype, device=self.device
                )
            del w, table
        return self.coll.all_reduce(parts, group)

    @torch.inference_mode()
    def encode_images(self, pixel_values, image_grid_thw):
        if self.vision is None:
            raise ConfigError(f"'{self.arch.name}' has no vision tower.")
        _, local = self._group("vision")
        w = self.loaders[local[0]].get("vision")  # replicated: one copy computes
        return self._encode(w, pixel_values, image_grid_thw)

    # -- layers ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run_layer(self, i, hidden, position_ids=None, attention_mask=None, cache=None):
        if not 0 <= i < self.num_layers:
            raise ConfigError(f"layer {i} does not exist; the model has {self.num_layers}.")
        unit = f"layer.{i}"
        if hidden is not None:
            self._shape = tuple(hidden.shape)
        hidden = self._handoff(hidden, self.stage_of[unit], i)
        group, local = self._group(unit)
        if not local:
            return None
        hidden = self._layer_input(hidden, i)
        past = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = self.default_positions(hidden, past)
        step = self._step_for(position_ids, attention_mask, hidden, past)
        ts, res = self.text, self.text.attn_res_block is not None
        x = hidden.to(self.dtype)
        h = x  # attention input: the residual stream, or the attention-residual mix
        # simulating several ranks: drop each rank's unit after its phase, so one rank's
        # unit is mapped at a time (a zstd unit is then decompressed once per phase)
        each = len(local) > 1
        parts = {}
        for r in local:
            w = self.loaders[r].get(unit, ATTENTION_PHASE)
            if res and r == local[0]:  # replicated vectors: one mix per process
                x, h = res_pre_attention(ts, w, x, i)
            lc = cache.for_rank(r).layer(i) if cache is not None else None
            parts[r] = attention_block(ts, self.linear, w, h, i, step, lc)
            del w
            if each:
                self.loaders[r].release()
        a = self.coll.all_reduce(parts, group)
        if not res:
            x = h = x + a
        if "latent.routed_expert_down_proj" in self.plan.units[unit]:
            return self._latent_moe(i, unit, group, local, x, a)
        parts = {}
        for r in local:
            w = self.loaders[r].get(unit, MLP_PHASE)
            if res and r == local[0]:
                x, h = res_post_attention(ts, w, x, a, i)
            parts[r] = mlp_block(ts, self.linear, w, h, self._slots(r, i))
            del w
            self.loaders[r].release()
        m = self.coll.all_reduce(parts, group)
        return AttnResState(x.blocks, x.partial + m) if res else x + m

    def _latent_moe(self, i: int, unit: str, group, local, x, a):
        """The MLP half of a latent-MoE layer (see the module docstring): the routed
        latent sums reduced before the norm, the shared experts in a second reduction."""
        ts, res = self.text, self.text.attn_res_block is not None
        h = x
        routed, shared = {}, {}
        for r in local:
            w = self.loaders[r].get(unit, MLP_PHASE)
            if res and r == local[0]:
                x, h = res_post_attention(ts, w, x, a, i)
            hn = rms_norm(h, w.need("norms.post_attention_layernorm"), ts.rms_eps)
            flat = hn.reshape(-1, hn.shape[-1])
            routed[r] = latent_routed(ts, self.linear, w, flat, self._slots(r, i))
            if "shared_experts.gate_proj" in w:
                shared[r] = gated_mlp(ts, self.linear, w, "shared_experts", hn).reshape(flat.shape)
            del w
            self.loaders[r].release()
        y = self.coll.all_reduce(routed, group)
        w = self.loaders[local[0]].get(unit, ("latent",))
        out = latent_finish(ts, self.linear, w, y, self.dtype)
        del w
        self.loaders[local[0]].release()
        if shared:
            out = out + self.coll.all_reduce(shared, group)
        m = out.view(h.shape)
        return AttnResState(x.blocks, x.partial + m) if res else x + m

    def _slots(self, rank: int, layer: int):
        """The (token, choice) slots ``rank`` computes in MoE layer ``layer`` (None: all)."""
        if layer not in self._slot_tables:
            copies = self.ranks.expert_copies(layer)
            if copies is None or (self.layout.moe_ep == 1 and all(len(c) == 1 for c in copies)):
                self._slot_tables[layer] = None
            else:
                most = max(len(c) for c in copies)
                table = torch.tensor(
                    [c + [c[0]] * (most - len(c)) for c in copies], dtype=torch.long
                )
                n = torch.tensor([len(c) for c in copies], dtype=torch.long)
                self._slot_tables[layer] = (table, n)
        tab = self._slot_tables[layer]
        if tab is None:
            return None
        table, n = tab
        ep_rank = self.layout.coords(rank)["ep_rank"]

        def slots(idx: torch.Tensor) -> torch.Tensor:
            cpu = idx.cpu()
            tok = torch.arange(cpu.shape[0])[:, None]
            copy = tok % n[cpu]
            return (table[cpu, copy] == ep_rank).to(idx.device)

        return slots

    # -- head -----------------------------------------------------------------------------
    @torch.inference_mode()
    def head(self, hidden):
        if hidden is not None:
            self._shape = tuple(hidden.shape)
        hidden = self._handoff(hidden, self.stage_of["head"])
        group, local = self._group("head")
        src = group[0]
        logits = None
        if local:
            hidden = self._layer_input(hidden, self.num_layers).to(self.dtype)
            parts = {}
            for r in local:
                w = self.loaders[r].get("head")
                if r == local[0]:
                    hidden = self._head_input(w, hidden)  # (replicated: one mix)
                h = rms_norm(hidden, w.need("norms.final_norm"), self.text.rms_eps)
                parts[r] = self.linear(w, "head.lm_head", h).float()
                sp = w.splits.get("head.lm_head", {})
                del w
            gathered = self.coll.all_gather(parts, group)
            if sp.get("split_dim") == 0:  # vocab-parallel: concatenate, trim the padding
                logits = torch.cat(gathered, dim=-1)[..., : self.vocab]
            else:  # replicated: the group's first rank's
                logits = gathered[0]
        b, s, _ = self._shape
        return self.coll.broadcast(logits, src, (b, s, self.vocab), torch.float32)

    def close(self) -> None:
        for ld in self.loaders.values():
            ld.close()


__all__ = ["ATTENTION_PHASE", "MLP_PHASE", "ParallelRuntime", "RankLoader"]

"""
infra/engine_weights.py: sync.EngineWeights as a served engine runs it: vLLM's fused layout,
residuals in host memory, syncs streamed one decoder layer per payload, every payload checked.

- layout "vllm": vLLM fuses q/k/v into `qkv_proj` (rows [q; k; v]) and gate/up into
  `gate_up_proj` (rows [gate; up]); each sub-layer's factor is applied to its own row block
  (`engine_layers`: infra/architectures.py's table). vLLM tensor parallelism inside an engine
  is not supported (Table 1's setup runs one engine per GPU): a sharded layer raises.
- `residual_device="cpu"`: the residuals in pinned host memory, merged chunk by chunk, for
  models whose residual does not fit beside the engine's weights and KV cache (27B).
- A full sync may arrive one decoder layer per payload (infra/engine_sync.layer_groups), and
  deltas are refused until every layer has been received; a delta too may be streamed, each
  layer once, in order. Every check runs before anything changes: unknown or repeated layers,
  shapes, seeds, the projection rule, finiteness (one device read a payload), bf16 ties.
Its factor merge is infra/batched.py's (sync.EngineWeights' bits: tests/test_sync.py,
test_batched_engine_merge_equals_the_reference), its `_load` sync's; the same bits, tested in
both layouts (tests/test_sync.py, test_200_payloads_track_the_trainer_in_both_layouts,
test_streamed_update_equals_one_payload, test_bad_payloads_are_rejected_and_change_nothing).
"""

import torch

import rowadam
import sync
from infra.batched import entry_magnitude, make_signs_many, merge_layers, shape_groups
from sketch import PROJECTION, clean_name, projection_from_signs, projection_seed
from sync import EngineWeights, Payload, bf16_ties


class StreamedEngineWeights(EngineWeights):
    """sync.EngineWeights with vLLM's layout (`layout="vllm"`, `engine_layers`), residuals where
    `residual_device` says, and payloads that may hold some of the targets (a streamed sync)."""

    exact = True  # keeps the fp32 master (infra/sparse_delta.py's engine does not)
    takes = "delta"  # the payloads `apply` merges (infra/sparse_delta.py's engine: "sparse")

    def __init__(self, model, *, base_seed, rank, layout="hf", update=0, residual_device=None, engine_layers=None,
                 checksums=None):
        if layout not in ("hf", "vllm") or (layout == "vllm" and not engine_layers):
            raise ValueError(f"layout must be 'hf' or 'vllm' (with its engine_layers), got {layout!r}")
        self.layout, self.engine_layers, self.residual_device = layout, engine_layers, residual_device
        self._loading = {}  # name -> update of a full sync that has not reached every layer yet
        self._merged = set()  # layers that merged the current update's delta (a streamed update)
        super().__init__(model, base_seed=base_seed, rank=rank, update=update, checksums=checksums)

    def _blocks(self, model):
        """[(clean sub-layer name, parameter, first row, rows)] of every target: layout "hf" one a
        module (sync.py's), layout "vllm" each of `engine_layers`' parts in its rows."""
        if self.layout == "hf":
            return super()._blocks(model)
        engine_layers = self.engine_layers
        blocks = []
        for name, module in model.named_modules():
            last = name.rsplit(".", 1)[-1]
            prefix = clean_name(name)[: -len(last)]
            if last in engine_layers:
                if getattr(module, "tp_size", 1) != 1:
                    raise NotImplementedError(f"{name}: tensor-parallel vLLM layers are not supported: run one "
                                              f"engine per GPU, as the paper does")
                parts = tuple(engine_layers[last])
                sizes = list(getattr(module, "output_sizes", [module.weight.shape[0]])) if len(parts) > 1 \
                    else [module.weight.shape[0]]  # one target: the whole layer (Phi-3's fused qkv_proj)
                if len(sizes) != len(parts) or sum(sizes) != module.weight.shape[0]:
                    raise ValueError(f"{name}: output_sizes {sizes} do not split {module.weight.shape[0]} rows into {parts}")
                row = 0
                for part, size in zip(parts, sizes):
                    blocks.append((prefix + part, module.weight, row, size))
                    row += size
        return blocks

    def state_bytes(self) -> int:
        """Bytes this object adds to the engine (the residuals), wherever they live."""
        return sum(s.residual.numel() * s.residual.element_size() for s in self.slots.values() if self.exact)

    def _residual(self, param, rows):
        if not self.exact:
            return None
        device = torch.device(self.residual_device) if self.residual_device is not None else param.device
        pin = device.type == "cpu" and param.device.type == "cuda"
        return torch.zeros(rows, param.shape[1], dtype=torch.int16, device=device,
                           pin_memory=pin)  # (d, k): the weights start as their own masters

    def _check(self, payload, kind):
        """Everything a payload must satisfy, checked before anything changes."""
        if payload.kind == "sparse" and kind == "delta":
            raise ValueError("this engine merges factors into its exact masters (exact=True): a sparse delta "
                             "would leave its residuals behind")
        if payload.kind != kind:
            raise ValueError(f"expected a {kind} payload, got {payload.kind}")
        if payload.base_seed != self.base_seed or payload.rank != self.rank:
            raise ValueError(f"payload has seed {payload.base_seed}, rank {payload.rank}; engine expects "
                             f"seed {self.base_seed}, rank {self.rank}")
        if kind == "delta" and payload.projection != PROJECTION:
            raise ValueError(f"the factors of update {payload.update} were merged with projection {payload.projection} "
                             f"and this engine makes A by projection {PROJECTION} (sketch.PROJECTION): the trainer and "
                             f"its engines must run one release of LoGRA; nothing was merged")
        unknown = sorted(set(payload.layers) - set(self.slots))[:3]
        if unknown or not payload.layers:
            raise ValueError(f"payload layers differ from the engine's: unknown {unknown}, "
                             f"{len(payload.layers)} layers")
        again = sorted(set(payload.layers) & self._merged)[:3] if kind != "full" else []
        if again:
            raise ValueError(f"payload for update {payload.update} already merged (duplicate) for {again}")
        for name, t in payload.layers.items():
            slot = self.slots[name]
            want = (slot.rows, self.rank) if kind == "delta" else tuple(slot.weight.shape)
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: tensor shape {tuple(t.shape)}, expected {want}")
        # Every layer's values finite (a sparse delta's: its values): one host read for the whole payload
        finite = torch.stack([torch.isfinite(t if isinstance(t, torch.Tensor) else t.values).all()
                              for t in payload.layers.values()])  # (layers,)
        if not bool(finite.all()):
            name = list(payload.layers)[int(finite.to(torch.int8).argmin())]
            raise ValueError(f"{name}: non-finite values in the payload")
        for name, t in payload.layers.items():
            if kind == "full" and self.exact and t.dtype == torch.float32 and bf16_ties(t):
                raise ValueError(f"{name}: {bf16_ties(t)} fp32 values lie exactly on a bf16 tie, which the engine's "
                                 f"bf16 + int16 state cannot hold; call rowadam.avoid_bf16_ties_ on the trainer's "
                                 f"weights before a full fp32 sync")

    @torch.no_grad()
    def apply(self, payload: Payload) -> None:
        """Merge W -= F @ A_update into the payload's targets (a sparse delta: write its elements):
        all of them, or some (one decoder layer per payload); once every target has merged it,
        the engine expects the next update. Only the current update number, each layer once."""
        if self._loading:
            raise ValueError(f"a full sync is incomplete ({len(self.slots) - len(self._loading)} of "
                             f"{len(self.slots)} layers missing): no delta can be merged")
        if self._merged and payload.kind != "full" and payload.update != self.update:
            raise ValueError(f"update {self.update} is incomplete ({len(self.slots) - len(self._merged)} layers "
                             f"missing): payload for update {payload.update} refused")
        if payload.update != self.update:
            what = "already merged (duplicate)" if payload.update < self.update else "skips updates"
            raise ValueError(f"payload for update {payload.update} {what}: engine expects update {self.update}")
        self._check(payload, self.takes)  # all checked before any change
        self._write(payload)
        self._merged.update(payload.layers)
        if len(self._merged) == len(self.slots):
            self.update, self._merged = self.update + 1, set()

    @torch.no_grad()
    def _merge_factors(self, payload) -> None:
        """sync.EngineWeights' merge, batched (infra/batched.py, the trainer's bits): every target's signs
        at once, the targets of one shape merged together where they fit rowadam.MERGE_ELEMENTS, a
        larger one (or one whose residual is in host memory) chunk by chunk."""
        names = list(payload.layers)
        slots = [self.slots[n] for n in names]
        device = slots[0].param.device
        signs = make_signs_many(self.rank, [s.weight.shape[1] for s in slots],
                                [projection_seed(self.base_seed, payload.update, s.name) for s in slots], device=device)
        magnitude = entry_magnitude(self.rank, torch.float32)  # |A's entries| as the trainer's fp32 A holds them
        factors = [payload.layers[n].to(device) for n in names]  # (d, r) each
        for same in shape_groups([s.weight for s in slots]):
            group = [slots[i] for i in same]
            per = rowadam.MERGE_ELEMENTS // group[0].weight.numel()
            if per < 2 or group[0].residual.device != device:
                for i in same:
                    self._merge_factor(slots[i], factors[i], projection_from_signs(signs[i]))
                continue
            for first in range(0, len(same), per):
                part = same[first:first + per]
                weights, residuals = [slots[i].weight for i in part], [slots[i].residual for i in part]
                hi, lo = torch.stack(weights), torch.stack(residuals)  # (L, d, k) bf16 and int16
                master = sync.join_master(hi, lo)  # (L, d, k) fp32
                merge_layers(list(master.unbind(0)), torch.stack([factors[i] for i in part]), [signs[i] for i in part],
                             magnitude, avoid_ties=False)  # W -= F A
                sync.store_master(master, hi, lo)  # ties avoided here
                torch._foreach_copy_(weights, list(hi.unbind(0)))
                torch._foreach_copy_(residuals, list(lo.unbind(0)))

    def _write(self, payload: Payload) -> None:
        self._merge_factors(payload)

    @torch.no_grad()
    def load_full(self, payload: Payload) -> None:
        """Replace target weights from a full payload: all of them, or some (a streamed sync,
        one decoder layer per payload); once every target has arrived with the same update
        number, the engine expects that update's delta next. fp32 payloads set the exact
        master (no bf16 ties allowed), bf16 ones a master equal to the bf16 weight."""
        self._check(payload, "full")
        if self._merged and self.exact:
            raise ValueError(f"update {self.update} is half merged: finish it before a full sync")
        self._merged = set()  # no master: full weights replace a half-written sparse update
        if self._loading and set(self._loading.values()) != {payload.update}:
            raise ValueError(f"a full sync for update {payload.update} arrived while one for update "
                             f"{next(iter(self._loading.values()))} is incomplete")
        for name, w in payload.layers.items():
            self._load(self.slots[name], w)
            self._loading[name] = payload.update
        if len(self._loading) == len(self.slots):
            self.update, self._loading = payload.update, {}

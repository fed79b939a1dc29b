"""sketch.py: the low-rank gradient sketch of a linear layer, never the full gradient.

A linear layer `Y = X W^T (+ b)`, W (d, k), has the weight gradient `G = dY^T X` (d, k). LoGRA
never builds G: forward keeps `P = X A^T` (N, r) instead of X (N, k), and backward adds
`dY^T P` into an fp32 sketch S (d, r). Activations kept and the gradient buffer shrink by r/k.
Shape legend: d out rows, k in columns, r rank, N tokens (all leading dims flattened).

Use
---
    import sketch  # `model`: a Hugging Face causal LM (fp32), `ids` (B, T); any other module names `targets`
    layers = sketch.attach(model, rank=8, seed=0)  # S = 0 and A_0 on every target nn.Linear; all frozen
    logits = model(input_ids=ids).logits           # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()                                # S += G A^T in every target; no parameter gets a .grad
    sketches = {layer.name: layer.sketch for layer in layers}  # (d, r) fp32 each: what RowAdam reads
    sketch.detach(model)                           # nn.Linear's forward and the requires_grad flags again

The math (arXiv:2610.06647, the method section on the low-rank gradient sketch)
-----------------------------------------------------------------------------
    S = G A^T = dY^T (X A^T)                                   (d, r)
    A[i, j] = +-1/sqrt(r), each with probability 1/2           E[A^T A] = I_k, so E[S A] = G
Code -> paper: `sketch` S, `projection` A, `signs` sqrt(r) A (int8), `rank` r, `update` t (updates merged; `refresh`:
A_t -> A_{t+1}). Each process makes A_t (`make_signs`), never sent, from `projection_seed(base_seed, t, name)` (sha256):
    mix32(x) = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15 (mod 2^32)
    c = i * ceil(k / 16) + b;  h = mix32(mix32(c ^ lo) ^ hi ^ 0x9E3779B9)   (lo, hi: the seed's words)
    A[i, 16 b + j] = -1/sqrt(r) where bit 16 + j of h is set, else +1/sqrt(r)    (`PROJECTION` = 2; 1 is refused)
Defaults: r = 256 (`PAPER_RANK`, Table 1), at most `default_rank` (departure 3); `TARGETS`: the paper's (departure 2).

Departures from the paper (numbered; reason; test)
-------------------------------------------------
1. S row-sharded as FSDP2 shards W, to fit: tests/test_rowadam.py, test_row_sharded_state_equals_one_process_bitwise.
2. A fused target (Phi-3's qkv_proj) is one layer, one A and one S, as the model computes it:
   tests/test_architectures.py, test_every_family_trains_and_its_engines_follow.
3. r at most half the narrowest target's width, a power of 2, so S holds at most half of G
   (bench/README.md, `defaults`): tests/test_sketch.py, test_default_rank_is_half_the_narrowest_width.

Implementation notes: the code's comments. Tests: tests/test_sketch.py, test_tiny_qwen2_sketches_equal_dense,
test_plain_module_sketches_equal_dense, test_signs_follow_the_documented_rule, test_refused_attach_changes_nothing.
Companions: infra/row_shard.py (departure 1), infra/batched.py (bench/README.md, `loop_phases_companions`).
"""

import hashlib
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F

# Every name a row of infra/architectures.py makes a target (the paper's seven, and fused ones).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
PAPER_RANK = 256  # Table 1's LoGRA rank
PROJECTION = 2  # the rule that makes A's signs ("The math"), recorded in checkpoints and payloads
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")  # FSDP1, checkpointing, compile


def clean_name(name: str) -> str:
    """`model._orig_mod.layers.0._checkpoint_wrapped_module.mlp.up_proj` -> `model.layers.0.mlp.up_proj`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def projection_seed(base_seed: int, update: int, name: str) -> int:
    """The seed of A_update for one layer: sha256 of "base_seed:update:clean_name", 8 bytes, int63."""
    if update < 0:
        raise ValueError(f"update must be >= 0, got {update}")
    text = f"{int(base_seed)}:{int(update)}:{clean_name(name)}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)

MASK32 = 0xFFFFFFFF
MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)  # below 2^31: a 32-bit word times one fits int64 on any device
ROUND_KEY = 0x9E3779B9  # xored in with the seed's high word, so that seed 0 is no fixed point (mix32(0) = 0)
SIGNS_PER_WORD = 16  # the 16 high bits of each hashed word give 16 signs


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit words in an int64 tensor (the `lowbias32` form of C. Wellons' hash prospector)."""
    for shift, multiplier in zip((16, 15), MIX_MULTIPLIERS):
        x = ((x ^ (x >> shift)) * multiplier) & MASK32
    return x ^ (x >> 15)


def check_signs(rank: int, width: int, seed: int) -> None:
    if rank <= 0 or width <= 0 or rank * -(-width // SIGNS_PER_WORD) > 2**32 or not 0 <= seed < 2**64:
        raise ValueError(f"a projection needs rank > 0 and width > 0 (2^32 counters at most) and a 64-bit unsigned "
                         f"seed, got rank, width, seed = {rank, width, seed}")


def make_signs(rank: int, width: int, seed: int, *, device=None) -> torch.Tensor:
    """sqrt(r) A (rank, width) as int8 +-1, projection version `PROJECTION` ("The math")."""
    rank, width, seed = int(rank), int(width), int(seed)
    check_signs(rank, width, seed)
    blocks = -(-width // SIGNS_PER_WORD)  # words per row
    c = torch.arange(rank * blocks, dtype=torch.int64, device=device)  # (r * blocks,) counters
    h = mix32(mix32(c ^ (seed & MASK32)) ^ ((seed >> 32) ^ ROUND_KEY))  # (r * blocks,) words
    bits = (h[:, None] >> torch.arange(16, 32, device=c.device)) & 1  # (r * blocks, 16): bit 16 + j
    return (1 - 2 * bits).to(torch.int8).view(rank, blocks * SIGNS_PER_WORD)[:, :width].contiguous()  # (r, k)


def projection_from_signs(signs: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A = signs / sqrt(r) (r, k) in `dtype`: +-1 times the scale, rounded once (exact for r a power of 4)."""
    return signs.to(dtype) * (1.0 / math.sqrt(signs.shape[0]))  # (r, k)


def make_projection(rank: int, width: int, seed: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """Rademacher A (rank, width), entries +-1/sqrt(rank), the same bits for a seed on any device."""
    return projection_from_signs(make_signs(rank, width, seed, device=device), dtype)


class _SketchedLinear(torch.autograd.Function):
    """Y = X W^T + b; backward adds dY^T (X A^T) into `sketch`, and gives dX if `input_grad`; no dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, projection, sketch, shard, input_grad, layer):
        y = F.linear(x, weight, bias)  # (..., d)
        # P = X A^T, kept for the sketch instead of X. Shapes: (N, k) @ (k, r) -> (N, r)
        p = x.reshape(-1, x.shape[-1]) @ projection.to(x.dtype).t()
        ctx.save_for_backward(p, weight)
        ctx.sketch, ctx.shard, ctx.input_grad, ctx.layer = sketch, shard, input_grad, layer
        return y

    @staticmethod
    def backward(ctx, dy):
        p, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, d)
        # Sketch: S += dY^T P, formed in the activations' dtype, added into the fp32 sketch.
        # Shapes: (d, N) @ (N, r) -> (d, r)
        product = sketch_product(dy2.t(), p, ctx.sketch.dtype)
        if ctx.shard is not None:  # this process keeps its rows of the sum over processes (departure 1)
            product = ctx.shard.reduce(product)
        ctx.sketch.add_(product)  # not addmm_: one process and a reduce-scatter add the same products
        if ctx.layer is not None:
            ctx.layer.backwards += 1  # a Python int on the host: no device read
        # Input gradient: dX = dY W, as in any linear layer. Shapes: (..., d) @ (d, k) -> (..., k)
        dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] and ctx.input_grad else None
        return dx, None, None, None, None, None, None, None


def sketch_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` in `dtype`, one GEMM in the factors' dtype: rounded once (the authors' way), or fp32 `_fp32_out_mm`."""
    out = _fp32_out_mm(a, b) if a.dtype != dtype and dtype == torch.float32 else None
    return (a @ b).to(dtype) if out is None else out

_FP32_OUT_MM = {}  # device type -> whether torch.mm(a, b, out_dtype=torch.float32) exists there, asked once


def _fp32_out_mm(a: torch.Tensor, b: torch.Tensor):
    """`torch.mm(a, b, out_dtype=torch.float32)` (CUDA's aten::mm.dtype), or None where it is missing or fails."""
    kind = a.device.type
    if kind not in _FP32_OUT_MM:
        try:
            _FP32_OUT_MM[kind] = torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", kind.upper())
        except (AttributeError, RuntimeError):  # an older torch: no such overload or query
            _FP32_OUT_MM[kind] = False
    try:
        return torch.mm(a, b, out_dtype=torch.float32) if _FP32_OUT_MM[kind] else None
    except torch.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError) as e:  # a build whose overload takes other inputs: None from now on
        _FP32_OUT_MM[kind] = False
        warnings.warn(f"torch.mm(..., out_dtype=torch.float32) failed on {kind} ({e}): products rounded from now on")


def sketched_linear(x, weight, bias, projection, sketch, shard=None, *, layer=None):
    """`x @ weight.T + bias` whose backward adds `dY^T (x A^T)` into `sketch` (d, r), or this process's
    rows of it (`shard`), counting into `layer.backwards`; under `torch.no_grad()` a plain `F.linear`."""
    d, k = weight.shape
    rows = d if shard is None else shard.rows(d)[1]
    if (x.shape[-1] != k or projection.shape[-1] != k or projection.dim() != 2
            or sketch.shape != (rows, projection.shape[0])):
        raise ValueError(f"x must have {k} features, projection must be (r, {k}) and sketch must be ({rows}, r), "
                         f"got x {tuple(x.shape)}, projection {tuple(projection.shape)}, sketch {tuple(sketch.shape)}")
    if not torch.is_grad_enabled():
        return F.linear(x, weight, bias)  # no backward will run: P would never be used
    if any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in (x, weight, bias)):
        raise ValueError("forward-mode AD through a sketched layer needs torch.no_grad() (as the KL probe runs)")
    input_grad = x.requires_grad  # False: nothing above requires grad, so a leaf copy that does reaches the sketch
    x = x if input_grad else x.detach().requires_grad_(True)  # (..., k)
    return _SketchedLinear.apply(x, weight, bias, projection, sketch, shard, input_grad, layer)


@dataclass(eq=False)
class LayerSketch:
    """One target layer: its clean name, module, the signs of A_t (r, k) and sketch S (d, r)."""

    name: str  # the clean module name, which seeds A (`projection_seed`)
    module: nn.Linear
    signs: torch.Tensor  # (r, k) int8 +-1: A_t = signs / sqrt(r)
    sketch: torch.Tensor  # (d, r), or this process's (n, r) rows with a shard; fp32 (float64 for float64 models)
    base_seed: int
    update: int = 0  # t of the A_t in use (the update counter)
    shard: object = None  # this process's rows (departure 1): infra/row_shard.py's RowShard, or None: every row
    backwards: int = 0  # backward passes into `sketch` since the last zero_() (0: backward never reached it)

    group = property(lambda self: None if self.shard is None else self.shard.group)  # the rows' process group
    rows = property(lambda self: self.module.weight.shape[0])  # d: all rows, whichever this process holds
    rank = property(lambda self: self.signs.shape[0])  # r
    projection = property(lambda self: projection_from_signs(self.signs, self.sketch.dtype))  # A_t (r, k)

    def projection_as(self, dtype) -> torch.Tensor:
        return projection_from_signs(self.signs, dtype)  # (r, k) A_t in `dtype`

    def all_rows(self, local: torch.Tensor) -> torch.Tensor:  # all d rows (d, r) of a row-sharded (n, r) U or F
        return local if self.shard is None else self.shard.gather(local, self.rows)

    def forward(self, x):  # the target's forward while attached
        m = self.module
        if m.weight.device != self.sketch.device:  # torch.device objects: compared without a sync
            raise RuntimeError(f"{self.name}: the weight is on {m.weight.device} but its sketch and signs are on "
                               f"{self.sketch.device}: move the model before attach, or detach and attach again")
        if not torch.is_grad_enabled():  # no backward follows (a rollout, the KL probe): no A to form
            return F.linear(x, m.weight, m.bias)
        a = projection_from_signs(self.signs, x.dtype)  # (r, k) A_t in the activations' dtype
        return sketched_linear(x, m.weight, m.bias, a, self.sketch, self.shard, layer=self)

    def refresh(self, update: int) -> None:
        refresh([self], update)  # A_update: after update - 1 was merged, or on resume

    def zero_(self) -> None:
        self.sketch.zero_()  # S = 0, and no backward counted into it
        self.backwards = 0


def refresh(layers, update: int) -> None:
    """Switch every layer to A_update (infra/batched.py's `refresh` makes them together)."""
    for layer in layers:
        seed = projection_seed(layer.base_seed, update, layer.name)
        layer.signs = make_signs(layer.rank, layer.signs.shape[1], seed, device=layer.signs.device)
        layer.update = update


def target_modules(model: nn.Module, targets=TARGETS) -> dict:
    """{clean name: module} of the modules whose last name part or clean name is in `targets`, or a mapping's."""
    if isinstance(targets, Mapping):
        return _mapped_targets(model, targets)
    names = (targets,) if isinstance(targets, str) else tuple(targets)  # one name, not its letters
    return {clean_name(n): m for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] in names or clean_name(n) in names}


def _mapped_targets(model: nn.Module, targets: Mapping) -> dict:
    """The mapping as given (its names, cleaned, seed A), refused unless it names modules of `model`, each once."""
    found = {clean_name(n): m for n, m in targets.items()}
    if len(found) < len(targets) or len({id(m) for m in found.values()}) < len(found):
        raise ValueError("targets name a module twice, or two names clean to one: give each module one name")
    if not {id(m) for m in found.values()} <= {id(m) for m in model.modules()}:
        raise ValueError(f"a target is not a module of this {type(model).__name__}: attach the model that holds it")
    return found


def default_rank(modules) -> int:
    """The paper's 256, or half the narrowest target's input width rounded down to a power of 2 (departure 3)."""
    narrowest = min(m.in_features for m in modules)
    return max(1, min(PAPER_RANK, 2 ** int(math.floor(math.log2(max(narrowest // 2, 1))))))


def attach(model: nn.Module, rank: int | None = None, seed: int = 0, targets=TARGETS, *,
           update: int = 0, shard=None) -> list[LayerSketch]:
    """Sketch every target nn.Linear (`target_modules`) at `rank` (None: `default_rank`), A_update from `seed`,
    freeze every parameter; `shard`: departure 1. Returns the layers in module order; `detach(model)` undoes it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach needs an nn.Module, got {type(model).__name__}")
    if getattr(model, "_logra_attached", None) is not None:
        raise RuntimeError("model already has sketches attached; call detach(model) first")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank <= 0):
        raise ValueError(f"rank must be a positive int (or None: default_rank's rule), got {rank!r}")
    found = target_modules(model, targets)
    if not found:
        what = "an empty mapping" if isinstance(targets, Mapping) else f"no nn.Linear named one of {targets}"
        raise ValueError(f"{what} in {type(model).__name__}: pass `targets`, names of its nn.Linear or a mapping")
    for name, module in found.items():  # every check before anything of the model changes
        if not isinstance(module, nn.Linear):
            raise TypeError(f"target {name} is a {type(module).__name__}, not nn.Linear: remove it from `targets`")
        if rank is not None and rank > module.in_features:  # default_rank never exceeds it
            raise ValueError(f"rank {rank} exceeds in_features {module.in_features} of {name}: choose a smaller rank")
        if "forward" in vars(module):  # detach() could not restore what it would replace
            raise RuntimeError(f"{name} already has its own forward (another attach's, a hook's): detach that first")
    rank = default_rank(found.values()) if rank is None else rank
    try:  # a Hugging Face model's input embedding, hooked as its enable_input_require_grads does (implementation notes)
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:  # PreTrainedModel's own, for a model that has no embedding
        embedding = None
    layers = []
    for name, module in found.items():
        w = module.weight
        rows = module.out_features if shard is None else shard.check(name, module)  # d, or n (departure 1)
        acc = torch.float64 if w.dtype == torch.float64 else torch.float32  # S's dtype
        s = torch.zeros(rows, rank, device=w.device, dtype=acc)  # S = 0 (d, r), or this process's (n, r)
        signs = make_signs(rank, module.in_features, projection_seed(seed, update, name), device=w.device)  # (r, k)
        layers.append(LayerSketch(name, module, signs, s, seed, update, shard))
    for layer in layers:  # the changes, none of which can fail
        layer.module.forward = layer.forward  # an instance attribute: `del` restores nn.Linear.forward
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}  # restored by detach
    for p in model.parameters():
        p.requires_grad_(False)
    hook = None if not isinstance(embedding, nn.Module) else embedding.register_forward_hook(
        lambda module, args, out: out.requires_grad_(True) if torch.is_grad_enabled() else out)
    model._logra_attached = (layers, frozen, hook)
    return layers


def detach(model: nn.Module) -> None:
    """Undo `attach`: plain nn.Linear forwards, original requires_grad flags, no hook."""
    if getattr(model, "_logra_attached", None) is None:
        raise RuntimeError("model has no sketches attached")
    layers, frozen, hook = model._logra_attached
    for layer in layers:
        del layer.module.forward
    for n, p in model.named_parameters():
        p.requires_grad_(frozen[n])
    if hook is not None:
        hook.remove()
    model._logra_attached = None

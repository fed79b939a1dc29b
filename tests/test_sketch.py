"""sketch.py against dense autograd, its unbiasedness, its memory and its determinism."""

import copy
import hashlib
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import sketch
from infra import architectures, batched
from tiny import tiny_batch, tiny_qwen2, use_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F64 = torch.float64


def dense_grad(x, weight, bias, dy):
    """G and dX from an ordinary nn.Linear backward (the reference)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    x = x.detach().clone().requires_grad_(True)
    lin(x).backward(dy)
    return lin.weight.grad, x.grad


# ---------------------------------------------------------------------------
# One layer, float64, against dense autograd

@settings(max_examples=30, deadline=None)
@given(d=st.integers(1, 33), k=st.integers(1, 40), r_frac=st.floats(0.01, 1.0),
       lead=st.lists(st.integers(1, 5), min_size=1, max_size=3), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1), micro=st.integers(1, 2))
def test_sketch_equals_dense_float64(d, k, r_frac, lead, bias, seed, micro):
    r = max(1, min(k, round(r_frac * k)))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, k, generator=g, dtype=F64)
    b = torch.randn(d, generator=g, dtype=F64) if bias else None
    a = sketch.make_projection(r, k, seed, dtype=F64)
    s = torch.zeros(d, r, dtype=F64)
    g_total = torch.zeros(d, k, dtype=F64)
    for _ in range(micro):  # micro-batches accumulate into the same sketch
        x = torch.randn(*lead, k, generator=g, dtype=F64)
        dy = torch.randn(*lead, d, generator=g, dtype=F64)
        xs = x.clone().requires_grad_(True)
        y = sketch.sketched_linear(xs, w, b, a, s)
        assert torch.equal(y, F.linear(x, w, b))
        y.backward(dy)
        g_ref, dx_ref = dense_grad(x, w, b, dy)
        g_total += g_ref
        torch.testing.assert_close(xs.grad, dx_ref, rtol=1e-12, atol=1e-12)
    ref = g_total @ a.t()  # (d, r)
    assert (s - ref).abs().max() <= 1e-10 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    d, k, r = 20, 36, 8
    w = torch.randn(d, k, generator=g).to(dtype)
    x = torch.randn(2, 5, k, generator=g).to(dtype)
    dy = torch.randn(2, 5, d, generator=g).to(dtype)
    a = sketch.make_projection(r, k, 5)
    s = torch.zeros(d, r)  # fp32 sketch whatever the compute dtype
    xs = x.clone().requires_grad_(True)
    sketch.sketched_linear(xs, w, None, a, s).backward(dy)
    assert s.dtype == torch.float32 and xs.grad.dtype == dtype
    g_ref, _ = dense_grad(x.double(), w.double(), None, dy.double())
    ref = g_ref @ a.double().t()
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: P = X A^T is stored in bf16
    assert ((s.double() - ref).norm() / ref.norm()).item() < tol


def test_forward_mode_under_no_grad_has_every_tangent():
    """The KL probe's setting: under no_grad a sketched layer is F.linear, so forward-mode AD
    carries the input's and the weight's tangents: dY = dX W^T + X dW^T."""
    g = torch.Generator().manual_seed(4)
    w, w_t = (torch.randn(6, 9, generator=g, dtype=F64) for _ in range(2))
    x, x_t = (torch.randn(3, 4, 9, generator=g, dtype=F64) for _ in range(2))
    a, s = sketch.make_projection(5, 9, 1, dtype=F64), torch.zeros(6, 5, dtype=F64)
    with torch.no_grad(), fwAD.dual_level():
        y = sketch.sketched_linear(fwAD.make_dual(x, x_t), fwAD.make_dual(w, w_t), None, a, s)
        tangent = fwAD.unpack_dual(y).tangent
    torch.testing.assert_close(tangent, x_t @ w.t() + x @ w_t.t(), rtol=1e-13, atol=1e-13)
    assert not s.any()  # no backward, no sketch


def test_forward_mode_with_grad_enabled_is_refused():
    w = torch.randn(6, 9, dtype=F64)
    x = torch.randn(3, 9, dtype=F64, requires_grad=True)
    a, s = sketch.make_projection(5, 9, 1, dtype=F64), torch.zeros(6, 5, dtype=F64)
    with fwAD.dual_level(), pytest.raises(ValueError, match="no_grad"):
        sketch.sketched_linear(fwAD.make_dual(x, torch.ones_like(x)), w, None, a, s)


def test_shape_errors():
    w, a = torch.zeros(4, 6), sketch.make_projection(2, 6, 0)
    with pytest.raises(ValueError, match=r"features.*got x \(3, 5\)"):
        sketch.sketched_linear(torch.zeros(3, 5), w, None, a, torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"sketch must be.*sketch \(2, 4\)"):
        sketch.sketched_linear(torch.zeros(3, 6), w, None, a, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"projection must be.*projection \(2, 5\)"):
        sketch.sketched_linear(torch.zeros(3, 6), w, None, torch.zeros(2, 5), torch.zeros(4, 2))


# ---------------------------------------------------------------------------
# The tiny Qwen2, against a plain copy trained densely

def lm_loss(model, ids):
    logits = model(input_ids=ids).logits  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_qwen2_sketches_equal_dense(checkpointing):
    model = tiny_qwen2(F64)
    dense = copy.deepcopy(model)
    layers = sketch.attach(model, rank=8, seed=11)
    assert len(layers) == 2 * 7
    if checkpointing:
        for m in (model, dense):
            architectures.enable_checkpointing(m)  # non-reentrant, under either transformers 5 name
    ids = tiny_batch()
    lm_loss(model, ids).backward()
    lm_loss(dense, ids).backward()
    modules = dict(dense.named_modules())
    for layer in layers:
        g = modules[layer.name].weight.grad  # (d, k)
        ref = g @ layer.projection.t()  # (d, r)
        assert ref.abs().max() > 0
        assert (layer.sketch - ref).abs().max() <= 1e-10 * ref.abs().max(), layer.name
    assert all(p.grad is None for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    assert all(layer.backwards == 1 for layer in layers)  # one backward, however checkpointing recomputes


def test_the_use_block_runs():
    """sketch.py's Use block, run on the tiny Qwen2 (fp32): every target's sketch is dense
    autograd's G A_0^T of the same loss, filled by one backward, and the model is detached."""
    model = tiny_qwen2()
    dense = copy.deepcopy(model)
    ids = tiny_batch()
    run = {"torch": torch, "model": model, "ids": ids}
    exec(use_block(sketch.__doc__), run)
    layers = run["layers"]
    assert len(layers) == 2 * 7 and list(run["sketches"]) == [layer.name for layer in layers]
    lm_loss(dense, ids).backward()
    modules = dict(dense.named_modules())
    for layer in layers:
        a0 = sketch.make_projection(8, layer.module.in_features, sketch.projection_seed(0, 0, layer.name), dtype=F64)
        ref = modules[layer.name].weight.grad.double() @ a0.t()  # (d, r)
        assert ref.abs().max() > 0 and layer.backwards == 1 and layer.sketch.dtype == torch.float32
        assert run["sketches"][layer.name] is layer.sketch
        torch.testing.assert_close(layer.sketch.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert not model.get_input_embeddings()._forward_hooks


def test_the_module_docstring_cites_tests_that_exist():
    """Each `tests/<file>, <test>[, <test>...]` that sketch.py's docstring gives for a departure or a
    note is a test defined in that file."""
    cited = [(file, name) for file, names in re.findall(r"tests/(test_\w+\.py),\s+(test_\w+(?:,\s+test_\w+)*)",
                                                          sketch.__doc__) for name in re.split(r",\s+", names)]
    assert len(cited) >= 7
    for file, name in cited:
        with open(os.path.join(ROOT, "tests", file)) as source:
            assert re.search(rf"^def {name}\(", source.read(), re.M), (file, name)


# ---------------------------------------------------------------------------
# Any nn.Module: a plain one, against dense autograd; refused attaches change nothing

class Block(nn.Module):
    """Issue 33's kind of module: Hugging Face's target names, no get_input_embeddings, and a
    norm before the first target, whose output (frozen) requires no grad."""

    def __init__(self, k=12, h=10, d=7, dtype=F64):
        super().__init__()
        self.norm = nn.LayerNorm(k, dtype=dtype)
        self.q_proj = nn.Linear(k, h, dtype=dtype)
        self.down_proj = nn.Linear(h, d, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(torch.tanh(self.q_proj(self.norm(x))))


class NoEmbedding(Block):
    """As a Hugging Face PreTrainedModel without an input embedding answers."""

    def get_input_embeddings(self):
        raise NotImplementedError


def sequential(dtype=F64):
    return nn.Sequential(nn.Linear(12, 11, dtype=dtype), nn.Tanh(), nn.Linear(11, 7, dtype=dtype))


PLAIN = {  # (model, targets): default names, a subclass, names of nn.Sequential's parts, a mapping
    "block": (Block, sketch.TARGETS),
    "no-embedding": (NoEmbedding, sketch.TARGETS),
    "sequential": (sequential, ("0", "2")),
    "mapping": (sequential, None),
}


def test_default_rank_is_half_the_narrowest_width():
    """sketch.py departure 3, against hand-worked cases: the largest power of 2 at most half the
    narrowest target's in_features, at most the paper's 256, at least 1; and attach uses it."""
    cases = {(64,): 32, (576, 4096): 256, (48, 96): 16, (1,): 1, (3,): 1, (4,): 2, (1024, 513): 256, (100, 7000): 32}
    for widths, want in cases.items():
        assert sketch.default_rank([torch.nn.Linear(k, 4) for k in widths]) == want, widths
    model = torch.nn.Sequential(torch.nn.Linear(48, 8), torch.nn.Linear(8, 2))
    layers = sketch.attach(model, targets={"a": model[0], "b": model[1]})
    assert [layer.rank for layer in layers] == [4, 4]  # half of 8, the narrowest


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_plain_module_sketches_equal_dense(case):
    """On a module without Hugging Face's embedding hook, two micro-batches' backward fill each
    target's sketch with dense autograd's G A^T (float64), no parameter gets a .grad, and the
    first target, whose input requires no grad, forms no dX (no (.., k) tensor in backward)."""
    make, targets = PLAIN[case]
    torch.manual_seed(0)
    model = make()
    dense = copy.deepcopy(model)
    if targets is None:
        targets = {"first": model[0], "second": model[2]}
    layers = sketch.attach(model, rank=5, seed=3, targets=targets)
    assert len(layers) == 2
    g = torch.Generator().manual_seed(1)
    shapes = set()
    for _ in range(2):
        x = torch.randn(3, 5, 12, generator=g, dtype=F64)  # requires no grad
        target = torch.randn(3, 5, 7, generator=g, dtype=F64)
        loss = ((model(x) - target) ** 2).sum()
        with ShapeRecorder() as rec:
            loss.backward()
        shapes |= rec.shapes
        ((dense(x) - target) ** 2).sum().backward()
    assert not any(s[-1:] == (12,) for s in shapes)  # the first target's dX was never formed
    modules = dict(dense.named_modules())
    for layer, path in zip(layers, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]):
        ref = modules[path].weight.grad @ layer.projection.t()  # (d, r)
        assert ref.abs().max() > 0 and layer.backwards == 2, layer.name
        assert (layer.sketch - ref).abs().max() <= 1e-12 * ref.abs().max(), layer.name
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    if case == "mapping":
        assert [layer.name for layer in layers] == ["first", "second"]
    sketch.detach(model)
    assert all("forward" not in vars(m) for m in model.modules()) and all(p.requires_grad for p in model.parameters())
    assert len(sketch.attach(model, rank=5, seed=3, targets=targets)) == 2  # and again: issue 33 failed here


def model_state(model):
    """What attach changes: each module's instance forward and hooks, each parameter's
    requires_grad flag, and the attachment record."""
    modules = [(n, "forward" in vars(m), list(m._forward_hooks), list(m._forward_pre_hooks))
               for n, m in model.named_modules()]
    return modules, [(n, p.requires_grad) for n, p in model.named_parameters()], getattr(model, "_logra_attached", None)


def test_refused_attach_changes_nothing():
    """Each misuse raises before anything changed, on a plain module and on the tiny Qwen2."""
    block = Block()
    block.norm.bias.requires_grad_(False)  # not every flag True: the flags are compared, not assumed
    patched = Block()
    patched.down_proj.forward = patched.down_proj.forward  # an instance forward, as a hook library leaves
    misuse = [
        (block, dict(targets=("q_proj", "norm")), TypeError, "norm is a LayerNorm, not nn.Linear"),
        (block, dict(rank=11), ValueError, "rank 11 exceeds in_features 10 of down_proj"),  # q_proj (k = 12) passed
        (block, dict(rank=0), ValueError, "rank must be a positive int"),
        (block, dict(targets=("nothing",)), ValueError, "no nn.Linear named one of"),
        (sequential(), {}, ValueError, "pass `targets`"),  # the default names match nothing in nn.Sequential
        (block, dict(targets={"q": block.q_proj, "other": nn.Linear(10, 7)}), ValueError, "not a module of"),
        (block, dict(targets={"q": block.q_proj, "again": block.q_proj}), ValueError, "twice"),
        (block, dict(targets={}), ValueError, "empty mapping"),
        (patched, {}, RuntimeError, "down_proj already has its own forward"),
    ]
    qwen = tiny_qwen2()
    misuse += [
        (qwen, dict(rank=49), ValueError, "exceeds in_features 48"),  # q_proj has k = 48; the MLP's down_proj 80
        (qwen, dict(targets=("q_proj", "mlp")), TypeError, "not nn.Linear"),
    ]
    for model, kw, error, message in misuse:
        before = model_state(model)
        with pytest.raises(error, match=message):
            sketch.attach(model, **{"rank": 4, "seed": 0, **kw})
        assert model_state(model) == before, (type(model).__name__, kw)
    assert not qwen.get_input_embeddings()._forward_hooks
    with pytest.raises(TypeError, match="nn.Module"):
        sketch.attach(object(), rank=4, seed=0)
    for model in (Block(), tiny_qwen2()):  # attached twice: the second attach changes nothing either
        sketch.attach(model, rank=4, seed=0)
        before = model_state(model)
        with pytest.raises(RuntimeError, match="already has sketches attached"):
            sketch.attach(model, rank=4, seed=0)
        assert model_state(model) == before
    assert len(model.get_input_embeddings()._forward_hooks) == 1  # the Qwen2's one hook


def test_a_moved_model_is_refused_and_a_cast_one_still_sketches():
    """A model moved after attach (here to the meta device) is refused in every forward, with
    or without gradients, naming the layer, both devices and the fix; detach and attach again
    is that fix. A dtype cast (bf16 weights, as FSDP2 mixed precision hands each forward) is
    not refused: the sketch stays fp32 and is still dense autograd's G A^T at bf16 accuracy."""
    model = sequential(torch.float32)
    layers = sketch.attach(model, rank=4, seed=0, targets=("0", "2"))
    model.to("meta")
    x = torch.randn(6, 12, device="meta")
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"^0: the weight is on meta but its "
                                                         r"sketch and signs are on cpu.*move the model before attach"):
            model(x)
    assert all(layer.backwards == 0 for layer in layers)
    sketch.detach(model)
    layers = sketch.attach(model, rank=4, seed=0, targets=("0", "2"))
    model(x).sum().backward()
    assert all(layer.sketch.device.type == "meta" and layer.backwards == 1 for layer in layers)

    model = sequential(torch.float32)
    dense = copy.deepcopy(model).to(torch.bfloat16).double()  # the bf16 weights, exactly, in float64
    layers = sketch.attach(model, rank=4, seed=0, targets=("0", "2"))
    model.to(torch.bfloat16)
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(2))
    model(x.to(torch.bfloat16)).float().square().sum().backward()
    dense(x.double()).square().sum().backward()
    for layer, ref in zip(layers, (dense[0].weight.grad, dense[2].weight.grad)):
        ref = ref @ layer.projection.double().t()  # (d, r)
        assert layer.sketch.dtype == torch.float32 and layer.backwards == 1
        assert ((layer.sketch.double() - ref).norm() / ref.norm()).item() < 3e-2


def test_backwards_counts_the_passes_since_zero():
    """`backwards` counts backward passes into the sketch: not forwards without one, not
    forwards without gradients; zero_() resets it with the sketch."""
    model = tiny_qwen2()
    layers = sketch.attach(model, rank=4, seed=0)
    ids = tiny_batch()
    with torch.no_grad():
        model(input_ids=ids)
    lm_loss(model, ids)  # a forward whose backward never runs
    assert all(layer.backwards == 0 for layer in layers)
    for _ in range(3):
        lm_loss(model, ids).backward()
    assert all(layer.backwards == 3 and layer.sketch.any() for layer in layers)
    for layer in layers:
        layer.zero_()
    assert all(layer.backwards == 0 and not layer.sketch.any() for layer in layers)


def test_attach_errors_and_detach():
    model = tiny_qwen2()
    with pytest.raises(ValueError, match="rank"):
        sketch.attach(model, rank=0, seed=0)
    with pytest.raises(ValueError, match="exceeds in_features"):
        sketch.attach(model, rank=49, seed=0)  # q_proj has k = 48
    with pytest.raises(ValueError, match="no nn.Linear"):
        sketch.attach(model, rank=4, seed=0, targets=("qkv_proj",))
    with pytest.raises(TypeError, match="not nn.Linear"):
        sketch.attach(model, rank=4, seed=0, targets=("mlp",))
    assert all(p.requires_grad for p in model.parameters())  # failed attaches changed nothing

    ids = tiny_batch()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    sketch.attach(model, rank=4, seed=0)
    with pytest.raises(RuntimeError, match="already"):
        sketch.attach(model, rank=4, seed=0)
    sketch.detach(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    lm_loss(model, ids).backward()  # plain dense gradients again
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_refresh_switches_projection():
    layers = sketch.attach(tiny_qwen2(), rank=4, seed=7)
    layer = layers[3]
    layer.refresh(5)
    expect = sketch.make_projection(4, layer.module.in_features, sketch.projection_seed(7, 5, layer.name))
    assert torch.equal(layer.projection, expect) and layer.update == 5
    assert layer.signs.dtype == torch.int8 and set(layer.signs.unique().tolist()) == {-1, 1}


# ---------------------------------------------------------------------------
# The signs of A: the documented rule, balanced and uncorrelated

def reference_signs(rank, width, seed):
    """The rule of sketch.py's "The math", written apart in numpy's uint32 arithmetic
    (its products wrap mod 2^32 by definition, where sketch.py keeps int64 below overflow)."""
    import numpy as np

    def mix32(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x21F0AAAD)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x735A2D97)
        return x ^ (x >> np.uint32(15))

    lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
    blocks = -(-width // 16)
    i, j = np.meshgrid(np.arange(rank, dtype=np.uint32), np.arange(width, dtype=np.uint32), indexing="ij")
    with np.errstate(over="ignore"):
        h = mix32(mix32((i * np.uint32(blocks) + j // np.uint32(16)) ^ lo) ^ hi ^ np.uint32(0x9E3779B9))
    bit = (h >> (np.uint32(16) + j % np.uint32(16))) & np.uint32(1)
    return torch.from_numpy(np.where(bit == 1, -1, 1).astype(np.int8))


@pytest.mark.parametrize("rank, width, seed", [(1, 1, 0), (3, 17, 0), (8, 64, 5), (16, 100, 2**32 - 1),
                                               (7, 33, 2**63 - 1), (4, 250, 2**64 - 1),
                                               (5, 40, sketch.projection_seed(0, 3, "model.layers.1.mlp.up_proj"))])
def test_signs_follow_the_documented_rule(rank, width, seed):
    assert torch.equal(sketch.make_signs(rank, width, seed), reference_signs(rank, width, seed))


@pytest.mark.parametrize("sign_batch", [None, 64])  # one batch per width; batches of a few projections
def test_signs_made_together_equal_one_at_a_time(sign_batch, monkeypatch):
    """infra/batched.py's make_signs_many (what train.py's refresh and the engines run) is
    sketch.make_signs one projection at a time, bit for bit: widths that are and are not
    multiples of 16, seeds of 0, 1 and 64 bits, one batch or many; its refresh is sketch.refresh's."""
    if sign_batch is not None:
        monkeypatch.setattr(batched, "SIGN_BATCH", sign_batch)
    widths, seeds = [17, 32, 17, 100, 32, 5, 17], [0, 1, 2**64 - 1, 7, 2**40 + 3, 9, 11]
    together = batched.make_signs_many(6, widths, seeds)
    assert all(torch.equal(t, sketch.make_signs(6, w, s)) for t, w, s in zip(together, widths, seeds))
    with pytest.raises(ValueError, match="64-bit unsigned"):
        batched.make_signs_many(4, [8, 8], [1, 2**64])
    model, twin = tiny_qwen2(), tiny_qwen2()
    ref, fast = sketch.attach(model, rank=8, seed=3), sketch.attach(twin, rank=8, seed=3)
    sketch.refresh(ref, 4)
    batched.refresh(fast, 4)
    assert all(torch.equal(a.signs, b.signs) and a.update == b.update == 4 for a, b in zip(ref, fast))


def test_sign_errors():
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="64-bit unsigned"):
            sketch.make_signs(4, 8, bad)
    with pytest.raises(ValueError, match="rank > 0 and width > 0"):
        sketch.make_signs(0, 8, 1)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**63 - 1), width=st.integers(300, 700))
def test_signs_are_balanced_and_uncorrelated(seed, width):
    """Hypothesis: every sign is +-1 with probability 1/2, independently. Under it each
    statistic below is a mean of n independent +-1 terms, standard deviation 1/sqrt(n): the
    share of +1 over the whole matrix; each pair of rows (what E[A^T A] = I needs: the sketch's
    columns uncorrelated); each pair of columns of one 16-bit word (the same hash output); and
    A against the next update's A. Bounds of 5.5 standard deviations: with these many pairs
    a true hypothesis fails one with probability below 1e-4."""
    r = 64
    a = sketch.make_signs(r, width, seed).double()  # (r, k)
    assert abs(a.mean().item()) < 5.5 / math.sqrt(a.numel())
    rows = (a @ a.t() / width)[~torch.eye(r, dtype=torch.bool)]  # (r (r - 1),): pairs of rows
    assert rows.abs().max().item() < 5.5 / math.sqrt(width)
    word = a[:, : width // 16 * 16].reshape(r, -1, 16)  # (r, words, 16): the signs of one hashed word
    pairs = torch.einsum("rwi,rwj->ij", word, word) / (word.shape[0] * word.shape[1])  # (16, 16)
    assert pairs[~torch.eye(16, dtype=torch.bool)].abs().max().item() < 5.5 / math.sqrt(word.shape[0] * word.shape[1])
    following = sketch.make_signs(r, width, sketch.projection_seed(seed, 1, "layer")).double()
    assert abs((a * following).mean().item()) < 5.5 / math.sqrt(a.numel())


# ---------------------------------------------------------------------------
# Unbiasedness: E[A^T A] = I and E[G A^T A] = G

def test_unbiased_estimator():
    r, k, d, n = 8, 12, 5, 4000
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(d, k, generator=g, dtype=F64)
    aa = torch.zeros(k, k, dtype=F64)
    est = torch.zeros(d, k, dtype=F64)
    sq = torch.zeros(d, k, dtype=F64)
    for i in range(n):
        a = sketch.make_projection(r, k, sketch.projection_seed(123, i, "layer"), dtype=F64)
        aa += a.t() @ a
        one = grad @ a.t() @ a  # one draw of the estimator (d, k)
        est += one
        sq += (one - grad) ** 2
    aa, est, sample_var = aa / n, est / n, sq / n
    # (A^T A)_jj = r * (1/r) = 1 exactly; off-diagonal entries are sums of r independent
    # +-1/r terms: mean 0, variance 1/r, so their n-sample mean has std 1/sqrt(r n).
    eye = torch.eye(k, dtype=F64)
    assert torch.allclose(aa.diagonal(), torch.ones(k, dtype=F64), atol=1e-12)
    off = (aa - eye)[~eye.bool()]
    assert off.abs().max() < 5.5 / math.sqrt(r * n)  # 132 entries: a 5.5-sigma miss has p < 1e-5
    # (G A^T A)_ij = G_ij + sum_{m != j} G_im (A^T A)_mj. The off-diagonal entries of one column
    # are pairwise uncorrelated, so Var = sum_{m != j} G_im^2 / r, and the mean of n draws has
    # std_ij = sqrt(sum_{m != j} G_im^2 / (r n)).
    var = ((grad**2).sum(1, keepdim=True) - grad**2) / (r * n)  # (d, k)
    z = (est - grad) / var.sqrt()
    assert z.abs().max() < 5.5
    # The bound rests on the derived variance: check it against the measured one
    # (each entry's sample variance over 4000 draws is within a few percent of the truth).
    ratio = (sample_var / (var * n)).mean()
    assert 0.9 < ratio < 1.1


# ---------------------------------------------------------------------------
# Memory: no (d, k) tensor in backward, X not kept

class ShapeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def backward_shapes(model, ids):
    loss = lm_loss(model, ids)
    with ShapeRecorder() as rec:
        loss.backward()
    return rec.shapes


def test_backward_never_makes_a_weight_shaped_tensor():
    model = tiny_qwen2()
    dense = copy.deepcopy(model)
    layers = sketch.attach(model, rank=8, seed=0)
    forbidden = set()
    for layer in layers:
        d, k = layer.module.weight.shape
        forbidden |= {(d, k), (k, d)}
    ids = tiny_batch(batch=2, length=7)  # N = 14 tokens: no dimension of a weight
    assert not (backward_shapes(model, ids) & forbidden)
    assert backward_shapes(dense, ids) & forbidden  # the check can see full gradients


def test_input_is_not_saved_only_its_projection():
    k, d, r, n = 40, 24, 6, 11
    x = torch.randn(n, k, requires_grad=True)
    w = torch.randn(d, k)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sketch.sketched_linear(x, w, None, sketch.make_projection(r, k, 0), torch.zeros(d, r))
    activations = [t for t in saved if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()]
    assert [tuple(t.shape) for t in activations] == [(n, r)]
    assert not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
    # The dense layer, by contrast, keeps X:
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.linear(x, w.requires_grad_(True))
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)


# ---------------------------------------------------------------------------
# Determinism across processes

PROBE = """
import hashlib, sketch
seed = sketch.projection_seed(42, 3, "model._orig_mod.layers.2._checkpoint_wrapped_module.mlp.down_proj")
a = sketch.make_projection(16, 100, seed)
print(seed, hashlib.sha256(a.numpy().tobytes()).hexdigest())
"""


def test_seed_and_projection_identical_across_processes():
    outs = []
    for hashseed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=ROOT)
        outs.append(subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout)
    assert outs[0] == outs[1]
    seed, digest = outs[0].split()
    # Wrapper parts do not change the seed; a different update or layer does.
    assert int(seed) == sketch.projection_seed(42, 3, "model.layers.2.mlp.down_proj")
    assert int(seed) != sketch.projection_seed(42, 4, "model.layers.2.mlp.down_proj")
    assert int(seed) != sketch.projection_seed(42, 3, "model.layers.2.mlp.up_proj")
    a = sketch.make_projection(16, 100, int(seed))
    assert hashlib.sha256(a.numpy().tobytes()).hexdigest() == digest


def test_projection_values_and_dtypes():
    a = sketch.make_projection(16, 300, 9)
    assert set(a.unique().tolist()) == {-0.25, 0.25}
    assert abs(a.sign().mean().item()) < 0.05
    assert torch.equal(sketch.make_projection(16, 300, 9, dtype=torch.bfloat16).float(), a)
    assert torch.equal(sketch.make_projection(16, 300, 9, dtype=F64).float(), a)
    assert not torch.equal(sketch.make_projection(16, 300, 10), a)

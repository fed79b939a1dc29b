"""rowadam.py against float64 re-computations of the paper's formulas, dense merges and 2 processes."""

import contextlib
import copy
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import kl_control
import rowadam
import sketch
import sync
from distributed import run_gloo
from infra import batched
from infra.row_shard import RowShard, row_shard
from infra import wire
from tiny import tiny_batch, tiny_qwen2, use_block

F64 = torch.float64


def reference_direction(s, v, step, beta2, eps):
    """RowAdam's formulas (rowadam.py's docstring, from the paper), written again in numpy float64."""
    s, v = np.asarray(s, np.float64), np.asarray(v, np.float64)
    v = beta2 * v + (1 - beta2) * (s**2).mean(axis=1)
    root = np.sqrt(v / (1 - beta2**step))
    den = root + max(eps * root.mean(), np.finfo(np.float64).tiny)
    sc = den.min() / den
    sc = sc / np.sqrt((sc**2).mean())
    d = sc[:, None] * s
    nd = np.linalg.norm(d)
    if nd > 0:
        d = d * np.linalg.norm(s) / nd
    return d, v


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 30), r=st.integers(1, 12), step=st.integers(1, 50),
       beta2=st.floats(0.0, 0.999), seed=st.integers(0, 2**31 - 1), zero_row=st.booleans())
def test_direction_matches_float64_reference(d, r, step, beta2, seed, zero_row):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(d, r, generator=g, dtype=F64) * torch.rand(d, 1, generator=g, dtype=F64) * 3
    if zero_row:
        s[0] = 0
    v = torch.rand(d, generator=g, dtype=F64) * (step > 1)
    ref_d, ref_v = reference_direction(s, v, step, beta2, 1e-8)
    out, new_v = rowadam.row_adam_direction(s, v, step=step, beta2=beta2)
    np.testing.assert_allclose(out.numpy(), ref_d, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(new_v.numpy(), ref_v, rtol=1e-13, atol=0)
    v = new_v
    # Invariants: each row of D is the same row of S times a positive number; ||D|| = ||S||;
    # a larger second moment gives a smaller row scale.
    assert math.isclose(out.norm().item(), s.norm().item(), rel_tol=1e-12)
    nz = s.abs().sum(1) > 0
    if not nz.any():
        assert not out.any()
        return
    ratio = (out[nz] * s[nz]).sum(1) / (s[nz] ** 2).sum(1)  # (rows,) scale of each row
    assert (ratio > 0).all()
    torch.testing.assert_close(out[nz], ratio[:, None] * s[nz], rtol=1e-10, atol=1e-14)
    order = torch.argsort(v[nz])
    assert (ratio[order].diff() <= 1e-12 * ratio.max()).all()


def test_zero_sketch_gives_zero_direction():
    out, v = rowadam.row_adam_direction(torch.zeros(5, 3), torch.zeros(5), step=1)
    assert torch.equal(out, torch.zeros(5, 3)) and torch.equal(v, torch.zeros(5))


@pytest.mark.parametrize("bad, match", [
    (dict(step=0), "1-based"),
    (dict(beta2=1.0), "beta2"),
    (dict(beta2=-0.1), "beta2"),
    (dict(eps=0.0), "eps"),
    (dict(second_moment=torch.ones(4)), "second moment"),
])
def test_direction_bad_input_leaves_moment(bad, match):
    kw = dict(sketch=torch.ones(3, 2), second_moment=torch.full((3,), 0.5), step=2)
    kw.update(bad)
    moment = kw["second_moment"]
    before = moment.clone()
    S, v = kw.pop("sketch"), kw.pop("second_moment")
    with pytest.raises(ValueError, match=match):
        rowadam.row_adam_direction(S, v, **kw)
    with pytest.raises(ValueError, match=match):  # infra/batched.py's stacks refuse the same inputs
        batched.row_adam_groups([S[None]], [v[None]], [torch.tensor([3.0], dtype=F64)], **kw)
    assert torch.equal(moment, before)


# ---------------------------------------------------------------------------
# On the tiny Qwen2

def lm_loss(model, ids):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def kl_probe_alpha(model, ids, mask):
    """The block's `choose_alpha`, as train.py chooses alpha: the KL probe, then solve_alpha."""
    def choose_alpha(layers, directions):
        probe = kl_control.probe(model, layers, directions, ids, mask)
        return kl_control.solve_alpha(probe.kl1, budget=kl_control.budget_for(probe))
    return choose_alpha


def test_the_use_block_runs():
    """The module docstring's Use block, run on the tiny Qwen2: the optimizer takes the layers'
    seed; it merges W - F A_0, with F the factors it returns and A_0 drawn again from the seed
    rule (dense, float64), counts one update, and leaves zeroed sketches on A_1. On a batch with
    no generated token the probe raises, and `discard()` has left the weights, moments and
    counter as they were and dropped the batch: a prepare() without a new backward is refused."""
    block = use_block(rowadam.__doc__)
    assert len(block.splitlines()) >= 8, block
    ids = tiny_batch(batch=3, length=9)
    mask = torch.zeros_like(ids)
    mask[:, 5:] = 1  # the last 4 tokens of each sequence are "generated"
    model = tiny_qwen2()
    before = {n: m.weight.detach().clone() for n, m in sketch.target_modules(model).items()}
    run = dict(model=model, ids=ids, loss_fn=lm_loss, choose_alpha=kl_probe_alpha(model, ids, mask))
    exec(block, run)
    opt, layers = run["opt"], run["layers"]
    assert opt.base_seed == 0 and opt.update == 1 and 0 < run["alpha"] <= 3.0
    for (name, m), f in zip(sketch.target_modules(model).items(), run["factors"]):
        w0, w = before[name], m.weight.detach()
        a0 = sketch.make_projection(8, w0.shape[1], sketch.projection_seed(0, 0, name), dtype=F64)  # (r, k)
        expect = w0.double() - f.double() @ a0  # (d, k)
        tol = 2 * torch.finfo(w.dtype).eps * w0.abs().max().item()  # fp32 rounding, and a tie's one ulp
        torch.testing.assert_close(w.double(), expect, rtol=0, atol=tol)
        assert not torch.equal(w, w0), name
    for layer in layers:
        a1 = sketch.make_projection(8, layer.module.in_features, sketch.projection_seed(0, 1, layer.name))
        assert torch.equal(layer.projection, a1) and not layer.sketch.any() and layer.backwards == 0

    model = tiny_qwen2()
    no_tokens = torch.zeros_like(ids)
    run = dict(model=model, ids=ids, loss_fn=lm_loss, choose_alpha=kl_probe_alpha(model, ids, no_tokens))
    with pytest.raises(ValueError, match="no generated token"):
        exec(block, run)
    opt, layers = run["opt"], run["layers"]
    assert opt.directions is None and opt.update == 0 and not any(v.any() for v in opt.moments)
    assert all(torch.equal(m.weight, before[n]) for n, m in sketch.target_modules(model).items())
    assert not any(layer.sketch.any() for layer in layers)  # the batch dropped
    with pytest.raises(ValueError, match="no backward"):
        opt.prepare()


def test_the_module_docstring_cites_tests_that_exist():
    """Each `tests/<file>::<test>` that rowadam.py's docstring gives as showing a departure or a
    note is a test defined in that file."""
    cited = re.findall(r"tests/(test_\w+\.py)::(test_\w+)", rowadam.__doc__)
    assert len(cited) >= 8
    for file, name in cited:
        with open(os.path.join(os.path.dirname(__file__), file)) as source:
            assert re.search(rf"^def {name}\(", source.read(), re.M), (file, name)


def setup(dtype=torch.float32, rank=8, seed=5, **kw):
    model = tiny_qwen2(dtype)
    layers = sketch.attach(model, rank=rank, seed=seed)
    kw.setdefault("factor_dtype", torch.bfloat16)
    return model, layers, rowadam.RowAdam(layers, seed=seed, **kw)


def weights(layers):
    return [l.module.weight.detach().clone() for l in layers]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_merge_realises_update_ratio(dtype):
    model, layers, opt = setup(dtype)
    lm_loss(model, tiny_batch()).backward()
    before = weights(layers)
    projections = [l.projection.clone() for l in layers]
    opt.prepare()
    alpha = 0.7
    factors = opt.merge(alpha)
    after = weights(layers)
    w_norm = math.sqrt(sum(w.double().square().sum().item() for w in before))
    step = math.sqrt(sum((b.double() - a.double()).square().sum().item() for b, a in zip(before, after)))
    # bf16 rounding of the factor moves the realised norm by ~2^-9 at most; in fp32 the
    # difference W_before - W_after also carries fp32 rounding of W (~1e-3 of the step).
    tol = 4e-3 if dtype == F64 else 1e-2
    assert math.isclose(step, alpha * opt.update_ratio * w_norm, rel_tol=tol)
    for b, a, f, p in zip(before, after, factors, projections):
        assert f.dtype == torch.bfloat16
        delta = f.to(F64) @ p.to(F64)  # (d, k), dense, only in the test
        if dtype == F64:
            torch.testing.assert_close(b - a, delta, rtol=1e-12, atol=1e-15)
        else:
            tol = 2 * torch.finfo(dtype).eps * b.abs().max().item()
            torch.testing.assert_close(a, b - delta.to(dtype), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_per_layer_scale_gives_each_layer_its_share_of_its_weights(dtype):
    """Departure 3: prepare(per_layer=True) scales each layer's direction to ||U_l A_l|| =
    update_ratio ||W_l||, measured with the dense float64 product U_l A_l; its direction is the
    one-scale direction's, layer by layer (the same D, another scale); a layer whose sketch is
    zero keeps U = 0; the moments are the one-scale path's, bit for bit."""
    runs = {}
    for per_layer in (False, True):
        model, layers, opt = setup(dtype, update_ratio=2e-3)
        lm_loss(model, tiny_batch()).backward()
        layers[3].sketch.zero_()  # a layer that the batch did not reach
        opt.prepare(per_layer=per_layer)
        runs[per_layer] = layers, [u.clone() for u in opt.directions], [v.clone() for v in opt._pending_moments]
    (_, one_scale, v1), (layers, per, v2) = runs[False], runs[True]
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for i, (layer, u, u1) in enumerate(zip(layers, per, one_scale)):
        w = layer.module.weight.detach().to(F64)
        step = (u.to(F64) @ layer.projection.to(F64)).norm().item()  # (d, k), dense, only in the test
        if i == 3:
            assert not u.any() and not u1.any()
            continue
        assert step == pytest.approx(2e-3 * w.norm().item(), rel=tol), layer.name
        ratio = (u.to(F64).norm() / u1.to(F64).norm()).item()
        torch.testing.assert_close(u.to(F64), u1.to(F64) * ratio, rtol=tol, atol=0)
    spread = [(u.to(F64) @ l.projection.to(F64)).norm().item() / l.module.weight.detach().to(F64).norm().item()
              for l, u in zip(layers, one_scale) if u.any()]
    assert max(spread) > 3 * min(spread)  # the one scale does not give every layer its share: the test can fail
    assert all(torch.equal(a, b) for a, b in zip(v1, v2))


def test_sharded_merge_equals_unsharded():
    g = torch.Generator().manual_seed(0)
    d, k, r = 37, 20, 6
    w = torch.randn(d, k, generator=g)
    f = torch.randn(d, r, generator=g).to(torch.bfloat16)
    a = sketch.make_projection(r, k, 3)
    full = w.clone()
    rowadam.merge_rows(full, f, a, chunk_rows=5)
    shards = [w[:19].clone(), w[19:].clone()]  # uneven, as FSDP2's chunking leaves the last one
    rowadam.merge_rows(shards[0], f, a, row_offset=0, chunk_rows=4)
    rowadam.merge_rows(shards[1], f, a, row_offset=19, chunk_rows=7)
    # float64 deltas rounded once: the same bits whatever the chunking or sharding
    assert torch.equal(torch.cat(shards), full)
    assert torch.equal(full, w - (f.double() @ a.double()).float())


@pytest.mark.parametrize("budget", [None, 10 * 24, 2])  # all layers in one batch; two a batch; row chunks
def test_layers_merged_together_equal_merge_rows_each(budget, monkeypatch):
    """infra/batched.py's merge_layers (what train.py's RowAdam and engines run): several layers of one shape
    merged with one batch of float64 operations, or in batches of two, or (a budget below one
    layer) each in row chunks, give bitwise merge_rows layer by layer, bf16 ties and rows of
    zero factors (left as they were, ties included) among them."""
    if budget is not None:
        monkeypatch.setattr(rowadam, "MERGE_ELEMENTS", budget)
    g = torch.Generator().manual_seed(5)
    L, d, k, r = 5, 10, 24, 16
    weights = [(torch.randn(d, k, generator=g) * 2).to(torch.bfloat16).float() for _ in range(L)]
    for w in weights:  # some exact bf16 ties, which the merge moves one ulp where F moves the row
        w.view(torch.int32)[:, ::5] |= 0x8000
    factors = (torch.randn(L, d, r, generator=g) * 1e-3).to(torch.bfloat16)
    factors[:, :3] = 0  # rows the merge leaves alone
    signs = [sketch.make_signs(r, k, seed) for seed in range(L)]
    magnitude = batched.entry_magnitude(r, torch.float32)
    before, expect = [w.clone() for w in weights], [w.clone() for w in weights]
    for w, f, s in zip(expect, factors, signs):
        rowadam.merge_rows(w, f, sketch.projection_from_signs(s))
    batched.merge_layers(weights, factors, signs, magnitude)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(weights, expect))
    # the test can fail: the moved rows moved, the others (ties and all) are as they were
    assert all(not torch.equal(w[3:], b[3:]) and torch.equal(bits(w[:3]), bits(b[:3])) for w, b in zip(weights, before))


@pytest.mark.parametrize("per_layer", [False, True])
def test_batched_rowadam_equals_the_reference(per_layer):
    """infra/batched.py's BatchedRowAdam (train.py's: stacks of layers, make_signs_many,
    merge_layers) against rowadam.RowAdam's per-layer loop over three updates: bitwise the same
    directions, factors, weights, moments and projections; the ||S|| that prepare returns sums the
    layers in another order, so it agrees to float64 rounding."""
    model = tiny_qwen2()
    twin = copy.deepcopy(model)
    ref_layers, fast_layers = sketch.attach(model, rank=8, seed=5), sketch.attach(twin, rank=8, seed=5)
    ref, fast = rowadam.RowAdam(ref_layers), batched.BatchedRowAdam(fast_layers)
    for step in range(3):
        for m in (model, twin):
            lm_loss(m, tiny_batch(seed=step)).backward()
        norms = ref.prepare(per_layer=per_layer), fast.prepare(per_layer=per_layer)
        assert norms[0] > 0 and math.isclose(*norms, rel_tol=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(ref.directions, fast.directions))
        assert all(torch.equal(a, b) for a, b in zip(ref.merge(0.7), fast.merge(0.7)))
        assert all(torch.equal(bits(a.module.weight.detach()), bits(b.module.weight.detach()))
                   for a, b in zip(ref_layers, fast_layers))
        assert all(torch.equal(a, b) for a, b in zip(ref.moments, fast.moments))
        assert all(torch.equal(a.signs, b.signs) for a, b in zip(ref_layers, fast_layers))
    assert ref.state_dict().keys() == fast.state_dict().keys() and fast.update == 3


def bits(x):
    """The raw fp32 words of `x`: torch.equal on them tells -0 from +0, which torch.equal on x does not."""
    return x.contiguous().view(torch.int32)


def test_merge_moves_bf16_ties_one_ulp_toward_zero():
    """Departure 2: after the merge every fp32 weight of a row the merge moves (its factor row
    not zero) that W - F A (float64, rounded once) left exactly halfway between two bf16 values
    is one ulp closer to zero (numpy's nextafter), and the rest of those rows are W - F A; each
    is then bf16(w) plus at most 32767 fp32 ulps, what an int16 holds. A row whose factor row is
    zero (+0 and -0 entries) is left bit for bit, its ties and a -0 weight included, also in a
    chunk that holds both kinds of rows. `avoid_ties=False` leaves W - F A, ties and all."""
    g = torch.Generator().manual_seed(2)
    d, k, r = 40, 24, 16
    still, faint = d // 4, d // 2  # rows [0, 10) not moved, rows [10, 20) moved by far less than an ulp
    w = torch.randn(d, k, generator=g)
    f = torch.randn(d, r, generator=g).to(torch.bfloat16)
    f[:still] = 0.0
    f[:still, ::2] = -0.0
    f[still:faint] *= 1e-20  # W - F A rounds back to W: on a tie, as W is
    bits(w)[:faint] = (bits(w)[:faint] & ~0xFFFF) | 0x8000  # rows [0, 20) on bf16 ties...
    w[0, 0] = w[still, 0] = -0.0  # ...but for two signed zeros
    a = sketch.make_projection(r, k, 4)
    plain = (w.double() - f.double() @ a.double()).float().numpy()  # (d, k) W - F A
    tie = (plain.view(np.uint32) & 0xFFFF) == 0x8000
    tie[:still] = False
    assert tie[still:faint].sum() == (faint - still) * k - 1
    plain[:still] = w[:still].numpy()  # the rows not moved: W itself, bit for bit (-0 included)
    expect = np.where(tie, np.nextafter(plain, np.float32(0)), plain)

    def ulps_from_bf16(x):
        return (x.view(torch.int32).long() - x.to(torch.bfloat16).float().view(torch.int32).long()).abs()

    merged, kept = w.clone(), w.clone()
    rowadam.merge_rows(merged, f, a, chunk_rows=7)  # chunks: [0, 7) not moved, [7, 14) both kinds, ...
    rowadam.merge_rows(kept, f, a, chunk_rows=7, avoid_ties=False)
    np.testing.assert_array_equal(merged.numpy().view(np.uint32), expect.view(np.uint32))
    np.testing.assert_array_equal(kept.numpy().view(np.uint32), plain.view(np.uint32))
    assert ulps_from_bf16(merged[still:]).max() <= 32767 and ulps_from_bf16(kept).max() == 32768
    assert ulps_from_bf16(merged[:still]).max() == 32768  # the ties of the rows not moved are kept
    assert bits(merged)[0, 0] == bits(torch.tensor(-0.0))  # -0 in a row not moved stays -0


def test_merge_of_alpha_zero_changes_no_weight_here_or_on_the_engine():
    """Departure 2: merge(0.0) leaves every weight bit for bit, bf16 ties and signed zeros
    included, and is an update all the same: the counter goes to 1, every layer to A_1 with a
    zeroed sketch, and the moments are those merge(1.0) commits on the same batch. An engine
    (sync.py) that merges its zero factors holds the trainer's master bit for bit, through it
    and through the next update, which moves the weights."""
    model, layers, opt = setup()
    twin_model, twin_layers, twin = setup()
    with torch.no_grad():
        for m in (model, twin_model):
            w = sketch.target_modules(m)["model.layers.0.self_attn.q_proj"].weight
            bits(w)[0, :8] = (bits(w)[0, :8] & ~0xFFFF) | 0x8000  # bf16 ties, which a merge moving W would move
            w[1, 0] = -0.0
    for m, o in ((model, opt), (twin_model, twin)):
        lm_loss(m, tiny_batch()).backward()
        o.prepare()
    before = weights(layers)
    factors = opt.merge(0.0)
    twin.merge(1.0)
    assert not any(f.any() for f in factors) and opt.update == twin.update == 1
    assert all(torch.equal(bits(w), bits(b)) for w, b in zip(weights(layers), before))
    assert sum(sync.bf16_ties(w) for w in weights(layers)) >= 8
    assert all(torch.equal(v, u) for v, u in zip(opt.moments, twin.moments))
    for l, t in zip(layers, twin_layers):
        assert torch.equal(l.projection, t.projection) and not l.sketch.any() and l.backwards == 0

    # The engine: from the trainer's tie-free master, as train.py starts it (no tie to move).
    model, layers, opt = setup(update_ratio=1e-3)
    with torch.no_grad():
        for l in layers:
            rowadam.avoid_bf16_ties_(l.module.weight)
    engine = sync.EngineWeights(tiny_qwen2(torch.bfloat16), base_seed=5, rank=8)
    engine.load_full(sync.full_payload({l.name: l.module.weight for l in layers}, update=0, base_seed=5, rank=8,
                                       dtype=torch.float32))
    for alpha in (0.0, 1.0):
        lm_loss(model, tiny_batch(seed=3 + opt.update)).backward()
        opt.prepare()
        before, update = weights(layers), opt.update
        payload = sync.Payload(update, 5, 8, {l.name: f for l, f in zip(layers, opt.merge(alpha))})
        engine.apply(wire.decode(wire.encode(payload)))
        assert engine.update == opt.update
        for l, b in zip(layers, before):
            assert torch.equal(bits(engine.master(l.name)), bits(l.module.weight.detach())), (alpha, l.name)
            assert torch.equal(bits(l.module.weight.detach()), bits(b)) == (alpha == 0.0), (alpha, l.name)


def test_refresh_after_merge():
    model, layers, opt = setup()
    lm_loss(model, tiny_batch()).backward()
    opt.prepare()
    opt.merge(1.0)
    assert opt.update == 1
    for l in layers:
        expect = sketch.make_projection(8, l.module.in_features, sketch.projection_seed(5, 1, l.name))
        assert torch.equal(l.projection, expect)
        assert not l.sketch.any()


def snapshot(layers, opt):
    return (weights(layers), [l.sketch.clone() for l in layers], [v.clone() for v in opt.moments], opt.update)


def assert_same(a, b):
    for xs, ys in zip(a[:3], b[:3]):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    assert a[3] == b[3]


def test_failures_change_nothing():
    model, layers, opt = setup()
    lm_loss(model, tiny_batch()).backward()
    with pytest.raises(RuntimeError, match="prepare"):
        opt.merge(1.0)
    layers[2].sketch[0, 0] = float("inf")
    before = snapshot(layers, opt)
    with pytest.raises(FloatingPointError):
        opt.prepare()
    assert_same(before, snapshot(layers, opt))
    layers[2].sketch[0, 0] = 0.0
    before = snapshot(layers, opt)
    opt.prepare()
    with pytest.raises(RuntimeError, match="already"):
        opt.prepare()
    for bad in (-0.1, float("nan"), float("inf"), 1e300):  # 1e300: finite, but F = alpha U overflows
        with pytest.raises(ValueError, match="alpha"):
            opt.merge(bad)
    assert_same(before, snapshot(layers, opt))
    opt.discard()  # an abandoned step: weights, moments and counter as they were, the batch dropped
    after = snapshot(layers, opt)
    assert_same((before[0], [], before[2], before[3]), (after[0], [], after[2], after[3]))
    assert not any(S.any() for S in after[1])


def test_prepare_without_a_backward_is_refused():
    """prepare() with no backward into any sketch since the optimizer was made, or since the
    last merge or discard, raises naming the fix and changes nothing (weights, sketches,
    moments, counter). A backward of a zero loss (every advantage zero) is not refused: its
    zero sketches give zero directions, whose merge changes no weight and counts the update."""
    model, layers, opt = setup()
    before = snapshot(layers, opt)
    with pytest.raises(ValueError, match=r"no backward .* call loss\.backward\(\) between merges"):
        opt.prepare()
    assert_same(before, snapshot(layers, opt))
    assert opt.directions is None

    (0.0 * lm_loss(model, tiny_batch())).backward()  # every advantage zero
    assert all(l.backwards == 1 for l in layers) and not any(l.sketch.any() for l in layers)
    assert opt.prepare() == 0.0 and not any(u.any() for u in opt.directions)
    before = weights(layers)
    opt.merge(1.0)
    assert opt.update == 1 and all(torch.equal(bits(w), bits(b)) for w, b in zip(weights(layers), before))

    for end in ("merge", "discard"):
        if end == "discard":
            lm_loss(model, tiny_batch()).backward()
            opt.prepare()
            opt.discard()
        before = snapshot(layers, opt)
        with pytest.raises(ValueError, match="no backward"):
            opt.prepare()
        assert_same(before, snapshot(layers, opt))
    lm_loss(model, tiny_batch()).backward()
    opt.prepare()  # a backward since: accepted
    assert any(u.any() for u in opt.directions)


def test_discard_drops_the_batch_and_keeps_the_optimizer():
    """discard() after prepare(), or without it, zeroes the sketches and their backward counts
    and keeps the weights, moments and counter as they were: the next batch's update is then
    bitwise that of an optimizer that never saw the discarded batches."""
    model, layers, opt = setup(update_ratio=1e-3)
    twin_model, twin_layers, twin = setup(update_ratio=1e-3)
    run_updates(model, layers, opt, 1, first=0)  # moments and a counter that are not the initial ones
    run_updates(twin_model, twin_layers, twin, 1, first=0)
    kept = snapshot(layers, opt)
    lm_loss(model, tiny_batch(seed=50)).backward()
    opt.prepare()
    opt.discard()
    lm_loss(model, tiny_batch(seed=51)).backward()
    opt.discard()  # without prepare(): a half-accumulated batch dropped too
    after = snapshot(layers, opt)
    assert_same((kept[0], [], kept[2], kept[3]), (after[0], [], after[2], after[3]))
    assert opt.directions is None and not any(l.sketch.any() or l.backwards for l in layers)
    for m, ls, o in ((model, layers, opt), (twin_model, twin_layers, twin)):
        lm_loss(m, tiny_batch(seed=52)).backward()
        o.prepare()
        o.merge(0.7)
    assert opt.update == twin.update == 2
    assert all(torch.equal(a, b) for a, b in zip(weights(layers), weights(twin_layers)))
    assert all(torch.equal(a, b) for a, b in zip(opt.moments, twin.moments))


def test_seed_is_the_layers_and_checked_when_given():
    """RowAdam takes the seed the layers were attached with; a seed that is given must be that
    seed (refused otherwise, naming both and the fix): one name, attach's."""
    _, layers, _ = setup(seed=7)
    assert rowadam.RowAdam(layers).base_seed == rowadam.RowAdam(layers, seed=7).base_seed == 7
    assert rowadam.RowAdam(layers).state_dict()["base_seed"] == 7
    with pytest.raises(ValueError, match=r"attached with seed 7, not seed=8.*leave seed out"):
        rowadam.RowAdam(layers, seed=8)


def test_bf16_weights_refused():
    model = tiny_qwen2(torch.bfloat16)
    layers = sketch.attach(model, rank=4, seed=0)
    with pytest.raises(TypeError, match="resolution"):
        rowadam.RowAdam(layers, seed=0)


def run_updates(model, layers, opt, n, first):
    for i in range(n):
        lm_loss(model, tiny_batch(seed=first + i)).backward()
        opt.prepare()
        opt.merge(0.5 + 0.1 * i)


def test_resume_is_bitwise():
    model, layers, opt = setup(update_ratio=1e-3)
    run_updates(model, layers, opt, 3, first=0)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    run_updates(model, layers, opt, 2, first=3)

    model2, layers2, opt2 = setup(update_ratio=1e-3)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.update == 3 and torch.equal(layers2[0].projection, layers[0].projection) is False
    run_updates(model2, layers2, opt2, 2, first=3)
    assert all(torch.equal(a, b) for a, b in zip(weights(layers), weights(layers2)))
    assert all(torch.equal(a, b) for a, b in zip(opt.moments, opt2.moments))

    _, _, other_seed = setup(seed=6)
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(saved_opt)
    _, _, other_rank = setup(rank=4)
    with pytest.raises(ValueError, match="rank"):
        other_rank.load_state_dict(saved_opt)
    fewer = copy.deepcopy(saved_opt)
    fewer["moments"].pop(next(iter(fewer["moments"])))
    with pytest.raises(ValueError, match="set of target layers"):
        opt2.load_state_dict(fewer)


# ---------------------------------------------------------------------------
# Two processes: FSDP2 row shards of the weights, and of every sketch, direction and moment
# (departure 1). One gloo run of two processes serves both tests below.

DIRECTION_ARGS = dict(step=3, beta2=0.9, eps=0.3)  # an eps large enough that mean(root) moves every den


def direction_inputs():
    """fp32 sketches (d, 6) and moments (d,) of four layers: d = 1 (the second process holds
    no row of it), 5 and 37 (uneven shards), and 8 with an all-zero sketch."""
    g = torch.Generator().manual_seed(7)
    sketches = [torch.randn(d, 6, generator=g) * torch.rand(d, 1, generator=g) * 3 for d in (1, 5, 37, 8)]
    sketches[3].zero_()
    return sketches, [torch.rand(S.shape[0], generator=g) for S in sketches]


def _directions_across_ranks(group):
    """This process's rows of every layer's D and new v, by the sharded path over `group`."""
    sketches, moments = direction_inputs()
    rows = [S.shape[0] for S in sketches]
    shards = [row_shard(d, group) for d in rows]  # (first row, row count) of each layer
    mine = [S[a:a + n] for S, (a, n) in zip(sketches, shards)]
    v = [m[a:a + n] for m, (a, n) in zip(moments, shards)]
    # each layer a stack of one: its own shape (row_adam_groups reduces all stacks in each collective)
    D, new_v = batched.row_adam_groups([S[None] for S in mine], [m[None] for m in v],
                                     [torch.tensor([d], dtype=torch.float64) for d in rows], group=group,
                                     **DIRECTION_ARGS)
    return [D_l[0] for D_l in D], [v_l[0] for v_l in new_v]


def _fsdp_updates(rank, per_layer=False):
    """Two updates of the FSDP2-sharded tiny Qwen2, each rank on its own batches: the full
    weights, directions and moments at the end (every rank takes part in gathering them).
    `per_layer`: RowAdam's scale per layer (departure 3)."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_qwen2()  # fp32
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    layers = sketch.attach(model, rank=8, seed=3, shard=RowShard(torch.distributed.group.WORLD))
    opt = batched.BatchedRowAdam(layers, seed=3, update_ratio=1e-3)
    for step in range(2):
        lm_loss(model, tiny_batch(seed=10 + 2 * step + rank)).backward()  # each rank its own data
        opt.prepare(per_layer=per_layer)
        # Each rank holds its rows only: ceil(d / 2) for rank 0.
        assert all(u.shape[0] == -(-l.rows // 2) or rank == 1 for u, l in zip(opt.directions, layers))
        dirs = [l.all_rows(u).clone() for l, u in zip(layers, opt.directions)]
        opt.merge(0.7)
    state = opt.state_dict()
    return {"weights": {n: m.weight.full_tensor() for n, m in sketch.target_modules(model).items()},
            "dirs": dirs, "moments": {n: v.full_tensor() for n, v in state["moments"].items()}}


def _whole_sketches(rank):
    """Whole sketches on each process, summed by prepare(group): one update to which only rank 1
    contributes a backward (accepted on both ranks: the backward counts are summed too), then a
    prepare() with no backward anywhere, refused on both (no rank left waiting in an all_reduce).
    Returns the directions of the update and the refusal's message."""
    model = tiny_qwen2()
    layers = sketch.attach(model, rank=8, seed=3)
    opt = rowadam.RowAdam(layers, update_ratio=1e-3)
    if rank == 1:
        lm_loss(model, tiny_batch(seed=20)).backward()
    group = torch.distributed.group.WORLD
    opt.prepare(group)
    dirs = [u.clone() for u in opt.directions]
    opt.merge(0.7)
    try:
        opt.prepare(group)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"dirs": dirs, "refused": refused, "update": opt.update}


@contextlib.contextmanager
def one_thread():
    """One intra-op thread, in the workers and in the one-process reference: a CPU matmul's bits
    can depend on the number of threads it runs on (here, 2 threads and 1 differ)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _two_ranks(rank, world, out_dir):
    torch.set_num_threads(1)  # as one_thread() runs the reference
    alone = [torch.distributed.new_group([r]) for r in range(world)]  # every rank creates every group
    result = {"directions": _directions_across_ranks(torch.distributed.group.WORLD),
              "alone": _directions_across_ranks(alone[rank]),  # the same path with world size 1
              "fsdp": _fsdp_updates(rank), "fsdp per layer": _fsdp_updates(rank, per_layer=True),
              "whole": _whole_sketches(rank)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    run_gloo(_two_ranks, 2, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_directions_across_ranks_equal_the_plain_formulas(two_ranks):
    """Departure 1: each layer's rows of D and v from the sharded path on 2 gloo processes, put
    together, are bitwise `row_adam_direction` on the whole layer in one process, and so are
    the sharded path's on a group of one process; a layer with no row on one process, uneven
    shards and an all-zero sketch included."""
    sharded = [r["directions"] for r in two_ranks]  # per rank: (its rows of every D, of every v)
    alone_D, alone_v = two_ranks[0]["alone"]
    for i, (S, v) in enumerate(zip(*direction_inputs())):
        D, new_v = rowadam.row_adam_direction(S, v, **DIRECTION_ARGS)
        assert torch.equal(torch.cat([D_r[i] for D_r, _ in sharded]), D), i
        assert torch.equal(torch.cat([v_r[i] for _, v_r in sharded]), new_v), i
        assert torch.equal(alone_D[i], D) and torch.equal(alone_v[i], new_v), i


@pytest.mark.slow
@pytest.mark.parametrize("per_layer", [False, True])
def test_row_sharded_state_equals_one_process_bitwise(two_ranks, per_layer):
    """Departure 1: 2 gloo ranks, each holding its rows of S, U, v and W, end with bitwise the
    weights, directions and moments of one process whose sketch holds both ranks' batches; with
    RowAdam's one scale and with the scale per layer (departure 3)."""
    got = two_ranks[0]["fsdp per layer" if per_layer else "fsdp"]
    model = tiny_qwen2()
    layers = sketch.attach(model, rank=8, seed=3)
    opt = batched.BatchedRowAdam(layers, seed=3, update_ratio=1e-3)
    with one_thread():
        for step in range(2):
            for r in range(2):
                lm_loss(model, tiny_batch(seed=10 + 2 * step + r)).backward()
            opt.prepare(per_layer=per_layer)
            dirs = [u.clone() for u in opt.directions]
            opt.merge(0.7)
    for (name, m), w in zip(sketch.target_modules(model).items(), got["weights"].values()):
        assert torch.equal(m.weight.detach(), w), name
    for a, b in zip(dirs, got["dirs"]):
        assert torch.equal(a, b)
    for l, v in zip(layers, opt.moments):
        assert torch.equal(v, got["moments"][l.name])


@pytest.mark.slow
def test_whole_sketches_refuse_a_missing_backward_on_every_rank_together(two_ranks):
    """prepare(group) over whole sketches: the backward counts are summed over the group, so
    an update with a backward on one rank only is accepted by both (each rank then holds the
    same directions) and one with no backward anywhere is refused by both, naming the fix."""
    whole = [r["whole"] for r in two_ranks]
    assert all(w["update"] == 1 for w in whole)
    assert all(torch.equal(a, b) for a, b in zip(whole[0]["dirs"], whole[1]["dirs"]))
    assert any(d.any() for d in whole[0]["dirs"])
    assert all(w["refused"] and "loss.backward()" in w["refused"] for w in whole)


def test_the_moment_weights_updates_by_the_sketch_of_the_per_token_mean_loss():
    """The scale of S (rowadam.py's implementation notes): over updates whose token counts N
    differ (19, 27, 23), RowAdam on the sketch of the per-token mean loss (S_sum / N) follows
    the float64 reference fed the same; the authors' extra division (S_sum / N^2) gives other
    directions from the second update on (the first is scale-free), so the choice is visible."""
    g = torch.Generator().manual_seed(11)
    d, r, beta2 = 12, 6, 0.95
    v_ours = v_ref = v_double = torch.zeros(d, dtype=F64)
    for step, n in enumerate((19, 27, 23), start=1):
        s_sum = torch.randn(d, r, generator=g, dtype=F64) * n  # a token-summed loss's sketch grows with N
        ours, v_ours = rowadam.row_adam_direction(s_sum / n, v_ours, step=step, beta2=beta2)
        ref, v_ref = reference_direction(s_sum / n, v_ref, step, beta2, 1e-8)
        np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-12, atol=1e-14)
        double, v_double = rowadam.row_adam_direction(s_sum / n**2, v_double, step=step, beta2=beta2)
        # Directions up to their scale (c rescales every layer together): compare unit directions.
        gap = ((ours / ours.norm()) - (double / double.norm())).norm().item()
        if step == 1:
            assert gap < 1e-12
        else:
            assert gap > 1e-3, (step, gap)


def test_a_cast_after_the_constructor_is_refused():
    """model.to(torch.bfloat16) after RowAdam was built: the next prepare refuses, and so does a
    merge whose prepare came before the cast, each with one line naming the cast and before
    anything changes (weights, moments, counter); cast back, the update goes through."""
    model, layers, opt = setup()
    ids = tiny_batch(batch=2, length=7, seed=3)
    lm_loss(model, ids).backward()
    moments, update = [v.clone() for v in opt.moments], opt.update
    model.to(torch.bfloat16)
    before = weights(layers)
    with pytest.raises(TypeError, match=r"was torch.float32 when RowAdam was built|resolution"):
        opt.prepare()
    model.to(torch.float32)
    opt.prepare()
    model.to(torch.bfloat16)
    before = weights(layers)
    with pytest.raises(TypeError, match="keep the weights fp32"):
        opt.merge(1.0)
    assert all(torch.equal(a, b) for a, b in zip(weights(layers), before))
    assert all(torch.equal(a, b) for a, b in zip(opt.moments, moments)) and opt.update == update
    model.to(torch.float32)
    opt.merge(1.0)
    assert opt.update == update + 1

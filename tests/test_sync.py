"""sync.py: engines that track the trainer bit for bit over 200 payloads, in both layouts; the
sparse delta's position codes against numpy and a Python reference, engines without a master
that follow LoGRA, AdamW and LoRA by sparse deltas, and the deltas they refuse."""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config

import rowadam
import sketch
import sync
from distributed import run_gloo
from infra import batched
from infra import checksum as fast_checksum, engine_sync, sparse_delta, wire
from infra.architectures import SEPARATE
from infra.engine_weights import StreamedEngineWeights
from infra.sparse_delta import SparseEngineWeights
from standin import vllm_standin
from tiny import tiny_batch, tiny_qwen2, use_block

SEED, RANK = 17, 8


def lm_loss(model, ids):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def trainer(update_ratio=6e-5):
    model = tiny_qwen2()
    with torch.no_grad():  # what train.py does before the start-up fp32 sync (rowadam.py departure 2)
        for m in sketch.target_modules(model).values():
            rowadam.avoid_bf16_ties_(m.weight)
    engine_model = copy.deepcopy(model).to(torch.bfloat16)
    layers = sketch.attach(model, rank=RANK, seed=SEED)
    opt = rowadam.RowAdam(layers, seed=SEED, update_ratio=update_ratio)
    return model, layers, opt, engine_model


def masters(layers):
    return {l.name: l.module.weight.detach() for l in layers}


def step(model, layers, opt, i, group=None):
    """One update on fresh data; returns the payload of what was merged."""
    lm_loss(model, tiny_batch(seed=1000 + i)).backward()
    opt.prepare(group)
    update = opt.update
    factors = opt.merge(1.0)
    return sync.Payload(update, SEED, RANK, {l.name: f for l, f in zip(layers, factors)})


def engine_weight(engine, name):
    s = engine.slots[name]
    return s.param.detach()[s.row:s.row + s.rows]


def test_the_use_block_runs():
    """The module docstring's Use block on the tiny Qwen2: after its one update the engine's
    master (bf16 weight + int16 residual) is the trainer's fp32 weight bit for bit, the
    trainer's weight is W_0 - F A_0 (A_0 drawn again from the seed rule, float64), and the
    payload is the factors' 2 d r bytes and a header, far below bf16 weights."""
    block = use_block(sync.__doc__)
    assert len(block.splitlines()) >= 10, block
    model = tiny_qwen2()
    engine_model = copy.deepcopy(model).to(torch.bfloat16)
    before = {n: m.weight.detach().clone() for n, m in sketch.target_modules(model).items()}
    run = dict(model=model, engine_model=engine_model, ids=tiny_batch(batch=3, length=9), loss_fn=lm_loss,
               alpha=1.0, torch=torch)
    exec(block, run)
    engine, factors, payload = run["engine"], run["factors"], run["payload"]
    assert engine.update == 1
    for (name, m), f in zip(sketch.target_modules(model).items(), factors):
        assert torch.equal(engine.master(name), m.weight.detach()), name  # bit for bit
        a0 = sketch.make_projection(8, m.in_features, sketch.projection_seed(0, 0, name), dtype=torch.float64)
        expect = before[name].double() - f.double() @ a0  # (d, k)
        tol = 2 * torch.finfo(torch.float32).eps * before[name].abs().max().item()  # rounding, a tie's ulp
        torch.testing.assert_close(m.weight.detach().double(), expect, rtol=0, atol=tol)
    factor_bytes = sum(2 * m.out_features * 8 for m in sketch.target_modules(model).values())
    sent = wire.encode(payload).numel()
    assert factor_bytes < sent < factor_bytes + 4096 < sum(2 * w.numel() for w in before.values())


def test_200_payloads_track_the_trainer_in_both_layouts():
    model, layers, opt, hf_engine_model = trainer()
    fused_model = vllm_standin(hf_engine_model)
    naive = {l.name: w.clone() for l, w in zip(layers, (l.module.weight.detach().to(torch.bfloat16) for l in layers))}
    engines = [sync.EngineWeights(hf_engine_model, base_seed=SEED, rank=RANK),  # the reference, HF layout
               StreamedEngineWeights(fused_model, base_seed=SEED, rank=RANK, layout="vllm", engine_layers=SEPARATE.engine)]
    start = sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32)
    for e in engines:
        e.load_full(wire.decode(wire.encode(start)))  # start-up resync over the buffer path
    for i in range(200):
        payload = wire.decode(wire.encode(step(model, layers, opt, i)))
        for e in engines:
            e.apply(payload)
        for l in layers:  # the naive engine: bf16 W -= bf16(F @ A) in place
            a = sketch.make_projection(RANK, l.module.in_features, sketch.projection_seed(SEED, i, l.name))
            naive[l.name] -= (payload.factors[l.name].float() @ a).to(torch.bfloat16)
    total = equal = naive_equal = 0
    for l in layers:
        ref = l.module.weight.detach().to(torch.bfloat16)  # bf16(trainer master)
        for e in engines:
            got = engine_weight(e, l.name)
            equal += (got == ref).sum().item()
            total += ref.numel()
        naive_equal += (naive[l.name] == ref).sum().item()
    assert equal == total, equal / total  # bf16 + int16 residual: exactly bf16(trainer master)
    trainer_fp = sync.fingerprint(layers)
    for e in engines:
        sync.check_fingerprints(trainer_fp, e.fingerprint())
    # The naive engine drifted: most updates were rounded away.
    assert naive_equal / (total / 2) < 0.9, naive_equal / (total / 2)
    ulps = max((naive[l.name].view(torch.int16).int() - l.module.weight.detach().to(torch.bfloat16)
                .view(torch.int16).int()).abs().max().item() for l in layers)
    assert ulps >= 2, ulps  # beyond the one-ulp band the tracked engines stay in


def snapshot(engine):
    return {n: (engine.master(n).clone(), engine_weight(engine, n).clone()) for n in engine.slots}, engine.update


def assert_unchanged(engine, snap):
    state, update = snap
    assert engine.update == update
    for n, (m, w) in state.items():
        assert torch.equal(engine.master(n), m) and torch.equal(engine_weight(engine, n), w)


def test_the_reference_engine_refuses_what_it_cannot_merge_and_changes_nothing():
    """sync.EngineWeights (one payload holds every target, in order): a payload of another
    update, kind, seed, a missing target, a wrong shape, a non-finite value, an fp32 bf16 tie
    are refused before anything changes; the good payload then merges as the trainer did."""
    model, layers, opt, engine_model = trainer()
    engine = sync.EngineWeights(engine_model, base_seed=SEED, rank=RANK)
    engine.load_full(sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32))
    good = step(model, layers, opt, 0)
    snap = snapshot(engine)
    first, f = next(iter(good.layers.items()))
    tie = {n: w.clone() for n, w in masters(layers).items()}
    tie[first].view(-1)[0] = torch.tensor(1.0 + 2**-8)  # exactly halfway between two bf16 values
    for bad in [sync.Payload(1, SEED, RANK, good.layers), sync.Payload(0, SEED + 1, RANK, good.layers),
                sync.Payload(0, SEED, RANK, good.layers, kind="full"),
                sync.Payload(0, SEED, RANK, {n: t for n, t in good.layers.items() if n != first}),
                sync.Payload(0, SEED, RANK, {**good.layers, first: f[:, :2]}),
                sync.Payload(0, SEED, RANK, {**good.layers, first: torch.full_like(f, float("nan"))}),
                sync.Payload(0, SEED, RANK, good.layers, projection=1)]:
        with pytest.raises(ValueError):
            engine.apply(bad)
        assert_unchanged(engine, snap)
    with pytest.raises(ValueError, match="bf16 tie"):
        engine.load_full(sync.full_payload(tie, update=0, base_seed=SEED, rank=RANK, dtype=torch.float32))
    assert_unchanged(engine, snap)
    engine.apply(good)
    assert engine.update == 1
    for l in layers:
        assert torch.equal(engine.master(l.name), l.module.weight.detach()), l.name


def test_bad_payloads_are_rejected_and_change_nothing():
    model, layers, opt, engine_model = trainer(update_ratio=1e-3)
    engine = StreamedEngineWeights(engine_model, base_seed=SEED, rank=RANK)
    engine.load_full(sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32))
    payloads = [step(model, layers, opt, i) for i in range(4)]
    engine.apply(payloads[0])
    engine.apply(payloads[1])
    snap = snapshot(engine)
    with pytest.raises(ValueError, match="skips"):
        engine.apply(payloads[3])
    with pytest.raises(ValueError, match="duplicate"):
        engine.apply(payloads[1])
    good = wire.encode(payloads[2])
    corrupt = good.clone()
    corrupt[-5] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        wire.decode(corrupt)
    with pytest.raises(ValueError, match="truncated|size mismatch"):
        wire.decode(good[:-3])
    with pytest.raises(ValueError, match="truncated"):
        wire.decode(good[:40])
    with pytest.raises(ValueError, match="magic"):
        wire.decode(torch.zeros(64, dtype=torch.uint8))
    header = good.clone()
    header[20:24] = torch.tensor(list(b"}}}}"), dtype=torch.uint8)
    with pytest.raises(ValueError, match="malformed"):
        wire.decode(header)
    p = payloads[2]
    for bad, match in [
        (sync.Payload(2, SEED + 1, RANK, p.factors), "seed"),
        (sync.Payload(2, SEED, RANK, {**p.factors, "model.layers.9.mlp.up_proj": p.factors["model.layers.0.mlp.up_proj"]}),
         "unknown"),
        (sync.Payload(2, SEED, RANK, {**p.factors, "model.layers.0.mlp.up_proj": torch.zeros(80, 4, dtype=torch.bfloat16)}), "shape"),
        (sync.Payload(2, SEED, RANK, {**p.factors, "model.layers.1.mlp.down_proj": torch.full((48, RANK), float("nan"), dtype=torch.bfloat16)}), "non-finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.apply(bad)
    # Factors merged with another projection (sketch.PROJECTION) are refused by the engine; a
    # buffer without the header's record (projection 1, a release before the versions) by decode,
    # in one line naming the version, full weights too.
    other = sync.Payload(2, SEED, RANK, wire.decode(good).layers, projection=1)
    with pytest.raises(ValueError, match="merged with projection 1 and this engine makes A by projection 2"):
        engine.apply(other)
    with pytest.raises(ValueError, match="projection 1 .* is refused") as refused:
        wire.decode(without_projection(good))
    assert "\n" not in str(refused.value) and wire.decode(good).projection == sketch.PROJECTION
    assert_unchanged(engine, snap)
    engine.apply(wire.decode(good))  # the right one still goes through
    assert engine.update == 3
    full = wire.encode(sync.full_payload(masters(layers), update=3, base_seed=SEED, rank=RANK, dtype=torch.float32))
    with pytest.raises(ValueError, match="projection 1 .* is refused"):
        wire.decode(without_projection(full))
    engine.load_full(wire.decode(full))
    assert engine.update == 3


def without_projection(buf):
    """`buf` re-encoded with its header's `projection` removed (a payload of an earlier release)."""
    n = len(wire.MAGIC)
    hlen = int.from_bytes(bytes(buf[n:n + 8].tolist()), "little")
    head = json.loads(bytes(buf[n + 8:n + 8 + hlen].tolist()))
    del head["projection"]
    text = json.dumps(head).encode()
    text += b" " * (-(n + 8 + len(text)) % wire.ALIGN)
    prefix = torch.frombuffer(bytearray(wire.MAGIC + len(text).to_bytes(8, "little") + text), dtype=torch.uint8)
    return torch.cat([prefix, buf[n + 8 + hlen:]])


def test_fused_row_offsets_for_real_configs():
    configs = {
        "Qwen2.5-Math-1.5B": Qwen2Config(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                         num_key_value_heads=2, num_hidden_layers=2),
        "Qwen2.5-Math-7B": Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                       num_key_value_heads=4, num_hidden_layers=2),
    }
    for cfg in configs.values():
        engine = StreamedEngineWeights(vllm_standin(config=cfg, device="meta"), base_seed=0, rank=256, layout="vllm", engine_layers=SEPARATE.engine)
        hd = cfg.hidden_size // cfg.num_attention_heads  # 128 for both
        q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
        expect = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv), "o_proj": (0, cfg.hidden_size),
                  "gate_proj": (0, inter), "up_proj": (inter, inter), "down_proj": (0, cfg.hidden_size)}
        assert len(engine.slots) == 7 * cfg.num_hidden_layers
        for name, slot in engine.slots.items():
            assert (slot.row, slot.rows) == expect[name.rsplit(".", 1)[-1]], name
            assert name.startswith("model.layers.")


def test_a_tensor_parallel_vllm_layer_is_refused():
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2)
    model = vllm_standin(config=cfg, device="meta")
    StreamedEngineWeights(model, base_seed=0, rank=8, layout="vllm", engine_layers=SEPARATE.engine)  # tensor parallel size 1: accepted
    model.model.layers[1].mlp.down_proj.tp_size = 2
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.down_proj: tensor-parallel"):
        StreamedEngineWeights(model, base_seed=0, rank=8, layout="vllm", engine_layers=SEPARATE.engine)


def test_fused_weights_match_hf_layout_blocks():
    hf = tiny_qwen2().to(torch.bfloat16)
    fused = StreamedEngineWeights(vllm_standin(hf), base_seed=0, rank=4, layout="vllm", engine_layers=SEPARATE.engine)
    plain = StreamedEngineWeights(hf, base_seed=0, rank=4)
    assert set(fused.slots) == set(plain.slots)
    for name in plain.slots:
        assert torch.equal(engine_weight(fused, name), engine_weight(plain, name))


# ---------------------------------------------------------------------------
# Two processes: trainer sends, engine receives

def _two_process(rank, world, out_dir):
    model, layers, opt, engine_model = trainer(update_ratio=1e-4)
    trainers = torch.distributed.new_group([0])  # the data-parallel group: the trainer alone
    prints = []
    if rank == 0:
        wire.send(sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32), None, 1)
        for i in range(5):
            wire.send(step(model, layers, opt, i, trainers), None, 1)
            prints.append(sync.fingerprint(layers))
    else:
        engine = StreamedEngineWeights(engine_model, base_seed=SEED, rank=RANK)
        engine.load_full(wire.recv(None, 0))
        for _ in range(5):
            engine.apply(wire.recv(None, 0))
            prints.append(engine.fingerprint())
    torch.save(prints, os.path.join(out_dir, f"fp{rank}.pt"))


@pytest.mark.slow
def test_two_process_sync(tmp_path):
    run_gloo(_two_process, 2, str(tmp_path))
    trainer_fp, engine_fp = (torch.load(tmp_path / f"fp{r}.pt") for r in range(2))
    assert len(trainer_fp) == len(engine_fp) == 5
    for a, b in zip(trainer_fp, engine_fp):
        sync.check_fingerprints(a, b)
    assert trainer_fp[0] != trainer_fp[-1]  # the weights did move


def test_fingerprint_mismatch_names_the_layer():
    _, layers, _, engine_model = trainer()
    engine = StreamedEngineWeights(engine_model, base_seed=SEED, rank=RANK)
    fp = engine.fingerprint()
    with torch.no_grad():
        engine.slots["model.layers.1.self_attn.v_proj"].param[3, 5] += 1.0
    with pytest.raises(RuntimeError, match="model.layers.1.self_attn.v_proj"):
        sync.check_fingerprints(fp, engine.fingerprint())
    # Checksums of row shards add up to the whole (FSDP2 fingerprints rely on it).
    w = torch.randn(37, 11).to(torch.bfloat16)
    parts = [fast_checksum.checksum_rows(w[:19], 0).tolist(), fast_checksum.checksum_rows(w[19:], 19).tolist()]
    assert tuple(map(sum, zip(*parts))) == sync.checksum(w)


def test_factor_payloads_join_decoder_layers_while_they_fit():
    groups = [["a0", "b0"], ["a1", "b1"], ["a2", "b2"], ["a3", "b3"]]
    size = {"a0": 3, "b0": 3, "a1": 2, "b1": 2, "a2": 9, "b2": 9, "a3": 1, "b3": 1}.get
    assert engine_sync.payload_groups(groups, size, 10) == [["a0", "b0", "a1", "b1"], ["a2", "b2"], ["a3", "b3"]]
    assert engine_sync.payload_groups(groups, size, 100) == [sum(groups, [])]  # a small model: one payload
    assert engine_sync.payload_groups(groups, size, 1) == groups  # each larger than the cap: one layer each
    assert engine_sync.payload_groups([], size, 10) == []


def test_checksum_against_a_word_by_word_recomputation():
    """infra/checksum.py sums columns of 65521 words at once: against numpy's word-by-word sums of
    the definition, on weights longer than a column and not a multiple of it, at row offsets
    whose first word falls mid-column, and in blocks smaller than the weight (CHECK_WORDS)."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    for shape, offset in (((300, 700), 0), ((300, 700), 77), ((5, 3), 123456), ((1, 65521), 1), ((40, 9000), 3)):
        w = (torch.randn(shape, generator=g) * 50).to(torch.bfloat16)
        x = w.view(torch.int16).numpy().astype(np.int64).ravel()
        i = offset * shape[1] + np.arange(x.size, dtype=np.int64)
        want = (int(x.sum()), int((x * (i % 65521 + 1)).sum()))
        assert tuple(fast_checksum.checksum_rows(w, offset).tolist()) == want, (shape, offset)
        if offset == 0:  # sync.checksum, the word by word reference, is the same sums
            assert sync.checksum(w) == want == fast_checksum.checksum(w)
    w = (torch.randn(64, 70000, generator=g)).to(torch.bfloat16)
    whole = sync.checksum(w)
    import unittest.mock
    with unittest.mock.patch.object(fast_checksum, "CHECK_WORDS", 3 * 65521):  # three columns a block
        assert fast_checksum.checksum(w) == whole
    ws = [w, w.float(), torch.zeros(0, 3), w[:7]]  # the fast path's one read for many: the reference's
    assert fast_checksum.checksums(ws) == sync.word_checksums(ws)


# ---------------------------------------------------------------------------
# The compact engine state: bf16 weight + int16 residual == the trainer's fp32 master

def hard_weights(d, k, seed):
    """fp32 weights that sit on bf16 ties, just below powers of two (the merges cross binade
    boundaries both ways), at +-0 and tiny magnitudes, besides ordinary values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, k, generator=g) * 0.05
    bits = w.view(torch.int32)
    n = w.numel() // 8
    flat = bits.view(-1)
    flat[:n] = (flat[:n] & ~0xFFFF) | 0x8000  # exact bf16 ties (either rounding direction)
    edge = torch.tensor([0.125, -0.125, 0.0625, -1.0 / 32], dtype=torch.float32).view(torch.int32)
    for j, e in enumerate(edge.tolist()):  # one fp32 ulp below a power of two, and exactly on it
        flat[n + 2 * j::97] = e - 1
        flat[n + 2 * j + 1::89] = e
    flat[-5:] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-38], dtype=torch.float32).view(torch.int32)
    return w


def test_compact_state_is_the_masters_bits_over_1000_updates():
    """1000 updates at update_ratio 6e-5 on weights full of bf16 ties and binade edges, in the
    HF and the fused vLLM layout: after every update each engine's weight is bf16 of the
    trainer's fp32 master, and weight + residual is the master itself, bit for bit."""
    cfg = dict(num_hidden_layers=1)
    model = tiny_qwen2(**cfg)
    modules = sketch.target_modules(model)
    with torch.no_grad():
        for i, m in enumerate(modules.values()):
            m.weight.copy_(hard_weights(*m.weight.shape, seed=i))
    ties = sum(sync.bf16_ties(m.weight) for m in modules.values())
    assert ties > 1000
    hf = copy.deepcopy(model).to(torch.bfloat16)
    engines = [StreamedEngineWeights(hf, base_seed=SEED, rank=RANK),
               StreamedEngineWeights(vllm_standin(hf), base_seed=SEED, rank=RANK, layout="vllm", engine_layers=SEPARATE.engine)]
    start = {n: m.weight.detach().clone() for n, m in modules.items()}
    with pytest.raises(ValueError, match="bf16 tie"):  # refused, and nothing changed
        engines[0].load_full(sync.full_payload(start, update=0, base_seed=SEED, rank=RANK, dtype=torch.float32))
    assert engines[0].update == 0 and not engines[0]._loading
    with torch.no_grad():
        for m in modules.values():
            rowadam.avoid_bf16_ties_(m.weight)
    moved = sum(int((m.weight.detach() != start[n]).sum()) for n, m in modules.items())
    assert moved == ties  # exactly the ties moved, each by one fp32 ulp toward zero
    assert all(((m.weight.detach() - start[n]).abs() <= start[n].abs() * 2**-23).all() for n, m in modules.items())
    for e in engines:
        e.load_full(sync.full_payload({n: m.weight for n, m in modules.items()}, update=0, base_seed=SEED,
                                      rank=RANK, dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    crossed = 0
    for update in range(1000):
        factors = {}
        for name, m in modules.items():
            d, k = m.weight.shape
            a = sketch.make_projection(RANK, k, sketch.projection_seed(SEED, update, name))
            f = (torch.randn(d, RANK, generator=g) * 6e-5 * m.weight.norm() / (d * k) ** 0.5).to(torch.bfloat16)
            before = m.weight.detach().abs().clone()
            with torch.no_grad():
                rowadam.merge_rows(m.weight.data, f, a)
            crossed += int((torch.frexp(before)[1] != torch.frexp(m.weight.detach().abs())[1]).sum())
            factors[name] = f
        payload = wire.decode(wire.encode(sync.Payload(update, SEED, RANK, factors)))
        for e in engines:
            e.apply(payload)
        if update % 50 == 49 or update < 3:
            for e in engines:
                for name, m in modules.items():
                    assert torch.equal(e.master(name), m.weight.detach()), (update, name)
                    assert torch.equal(engine_weight(e, name), m.weight.detach().to(torch.bfloat16))
    assert crossed > 0  # some merges crossed a binade boundary
    assert sum(sync.bf16_ties(m.weight) for m in modules.values()) == 0  # the merges leave no tie
    for e in engines:
        sync.check_fingerprints(sync.fingerprint(model), e.fingerprint())
        # 2 bytes per target weight: half of an fp32 master copy.
        assert e.state_bytes() == 2 * sum(m.weight.numel() for m in modules.values())


def test_store_master_is_the_tie_rule_then_the_split():
    """sync.store_master (the engine's six-pass split) gives the bits of
    rowadam.avoid_bf16_ties_ followed by split_master, on values of both signs over 11 decades,
    a third of them forced onto bf16 ties, signed zeros and the largest finite values."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 300, generator=g) * torch.logspace(-8, 3, 300)
    bits = w.view(torch.int32)
    tie = torch.rand(w.shape, generator=g) < 0.3
    bits[tie] = (bits[tie] & -0x10000) | 0x8000
    w[0, :6] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.38e38, -3.38e38])
    ref = rowadam.avoid_bf16_ties_(w.clone())
    hi, lo = sync.split_master(ref)
    weight, residual = torch.empty(w.shape, dtype=torch.bfloat16), torch.empty(w.shape, dtype=torch.int16)
    sync.store_master(w.clone(), weight, residual)
    assert sync.bf16_ties(w) > 40000
    assert torch.equal(weight.view(torch.int16), hi.view(torch.int16)) and torch.equal(residual, lo)
    assert torch.equal(sync.join_master(weight, residual).view(torch.int32), ref.view(torch.int32))


def test_streamed_full_sync_equals_one_payload():
    model, layers, opt, engine_model = trainer()
    one = StreamedEngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    streamed = StreamedEngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    for i in range(3):  # move the trainer first
        step(model, layers, opt, i)
    weights = {n: w.clone() for n, w in masters(layers).items()}
    one.load_full(sync.full_payload(weights, update=3, base_seed=SEED, rank=RANK, dtype=torch.float32))
    groups = engine_sync.layer_groups(weights)
    assert [len(g) for g in groups] == [7, 7] and groups[0][0].startswith("model.layers.0.")
    for n, names in enumerate(groups):
        part = sync.full_payload({k: weights[k] for k in names}, update=3, base_seed=SEED, rank=RANK,
                                 dtype=torch.float32)
        streamed.load_full(wire.decode(wire.encode(part)))
        if n == 0:  # half a sync: no delta may be merged yet
            assert streamed.update == 0
            zeros = {k: torch.zeros(w.shape[0], RANK, dtype=torch.bfloat16) for k, w in weights.items()}
            with pytest.raises(ValueError, match="incomplete"):
                streamed.apply(sync.Payload(0, SEED, RANK, zeros))
    assert streamed.update == one.update == 3
    for name in weights:
        assert torch.equal(streamed.master(name), one.master(name))
    sync.check_fingerprints(one.fingerprint(), streamed.fingerprint())


def test_streamed_update_equals_one_payload():
    """An update sent one decoder layer per payload (the trainer gathers F layer by layer)
    merges to the same bits as one payload; a half-merged update refuses anything else."""
    model, layers, opt, engine_model = trainer()
    one = StreamedEngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    parts = StreamedEngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    start = sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32)
    one.load_full(start)
    parts.load_full(start)
    payloads = [step(model, layers, opt, i) for i in range(2)]
    for p in payloads:
        one.apply(p)
        first, second = engine_sync.layer_groups(p.factors)
        parts.apply(sync.Payload(p.update, SEED, RANK, {n: p.factors[n] for n in first}))
        assert parts.update == p.update  # not complete yet
        snap = snapshot(parts)
        with pytest.raises(ValueError, match="duplicate"):
            parts.apply(sync.Payload(p.update, SEED, RANK, {n: p.factors[n] for n in first}))
        with pytest.raises(ValueError, match="incomplete"):
            parts.apply(sync.Payload(p.update + 1, SEED, RANK, {n: p.factors[n] for n in second}))
        with pytest.raises(ValueError, match="half merged"):
            parts.load_full(start)
        assert_unchanged(parts, snap)
        parts.apply(sync.Payload(p.update, SEED, RANK, {n: p.factors[n] for n in second}))
    assert parts.update == one.update == 2
    for name in one.slots:
        assert torch.equal(parts.master(name), one.master(name))
    sync.check_fingerprints(sync.fingerprint(layers), parts.fingerprint())


# -----------------------------------------------------------------------------
# Sparse deltas: the bf16 elements an update changed, for engines without a master

def leb128(values):
    """Unsigned LEB128 of each value, a pure-Python reference."""
    out = []
    for v in values:
        while True:
            byte, v = v & 0x7F, v >> 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                break
    return out


@pytest.mark.parametrize("chunk", [sparse_delta.CODE_CHUNK, 5])  # 5: many chunks of either code
@pytest.mark.parametrize("numel,share", [(5000, 0.0), (5000, 0.003), (5000, 0.03), (5000, 0.4), (7, 1.0),
                                         (2**21, 0.0005)])
def test_position_codes_against_numpy_and_python(numel, share, chunk, monkeypatch):
    import numpy as np

    monkeypatch.setattr(sparse_delta, "CODE_CHUNK", chunk)

    mask = np.random.default_rng(int(share * 1e4) + numel).random(numel) < share
    positions = torch.from_numpy(np.flatnonzero(mask))
    gaps = np.diff(np.flatnonzero(mask), prepend=-1) - 1
    reference = {"bitmap": np.packbits(mask, bitorder="little").tolist(), "gaps": leb128(gaps.tolist())}
    code, data = sparse_delta.encode_index(positions, numel)
    assert code == ("bitmap" if len(reference["gaps"]) > len(reference["bitmap"]) else "gaps")  # the smaller, gaps on a tie
    assert data.tolist() == reference[code]
    for other in reference:  # either code decodes to the positions
        back = sparse_delta.decode_index(other, torch.tensor(reference[other], dtype=torch.uint8), len(positions), numel)
        assert torch.equal(back, positions)
    bad = torch.tensor(leb128([3, 200]), dtype=torch.uint8)
    with pytest.raises(ValueError, match="truncated"):
        sparse_delta.decode_index("gaps", bad[:-1], 2, numel)
    with pytest.raises(ValueError, match="header says"):
        sparse_delta.decode_index("gaps", torch.tensor(leb128([1, 2]), dtype=torch.uint8), 3, numel)
    with pytest.raises(ValueError, match="outside|beyond"):
        sparse_delta.decode_index("gaps", torch.tensor(leb128([numel]), dtype=torch.uint8), 1, numel)
    for bad in ([3, 3], [4, 2], [-1, 2], [0, numel]):  # repeated, decreasing, negative, beyond the weight
        with pytest.raises(ValueError, match="increasing|outside"):
            sparse_delta.encode_index(torch.tensor(bad), numel)


def payload_data_bytes(buf: torch.Tensor) -> int:
    """The bytes of a payload after its header (encode's `data_bytes`), read from the buffer."""
    head = len(wire.MAGIC) + 8 + int.from_bytes(bytes(buf[len(wire.MAGIC):len(wire.MAGIC) + 8].tolist()), "little")
    return buf.numel() - head


@pytest.mark.parametrize("shape", [(48, 80), (24, 48), (7, 5)])
def test_a_delta_never_sends_more_than_the_full_weight(shape):
    """At every share of changed elements, from none to all (LoRA's first merge), a sparse delta's
    bytes after the header are at most a full bf16 sync's of the same weight: the changed
    elements where they are smaller, the dense form from the crossing on, exactly the weight;
    and every form decodes and writes the new weight into an engine without a master."""
    numel = shape[0] * shape[1]
    g = torch.Generator().manual_seed(11)
    before = torch.randn(shape, generator=g).to(torch.bfloat16)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].q_proj = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
    name = "model.layers.0.q_proj"
    full = payload_data_bytes(wire.encode(sync.full_payload({name: before}, update=0, base_seed=SEED, rank=1)))
    assert full == 2 * numel + -2 * numel % wire.ALIGN
    forms = set()
    for changed in sorted({0, 1, numel // 16, numel // 2, numel * 15 // 16 - 1, numel * 15 // 16,
                           numel * 15 // 16 + 1, numel - 1, numel}):
        engine = SparseEngineWeights(model, base_seed=SEED, rank=1)
        engine.load_full(sync.full_payload({name: before}, update=0, base_seed=SEED, rank=1))
        after = before.clone().flatten()
        chosen = torch.randperm(numel, generator=g)[:changed]
        after[chosen] = (after[chosen].float() + 1.0).to(torch.bfloat16)  # + 1 changes every bf16 value here
        after = after.view(shape)
        delta = wire.sparse_delta(shape, *sparse_delta.changed_elements(before, after), sync.checksum(before),
                                  whole=lambda: after)
        buf = wire.encode(sync.Payload(0, SEED, 1, {name: delta}, kind="sparse"))
        assert payload_data_bytes(buf) <= full, (changed, payload_data_bytes(buf), full)
        forms.add("dense" if delta.positions is None else "sparse")
        if delta.positions is None:
            assert payload_data_bytes(buf) == full and changed >= numel * 7 // 8, changed
        else:
            assert len(delta.values) == changed
        engine.apply(wire.decode(buf))
        assert torch.equal(engine_weight(engine, name), after), changed
    assert forms == {"dense", "sparse"}


class Shadow:
    """The trainer's side of a sparse delta, as engine_sync.delta does it on one process."""

    def __init__(self, weights):
        self.held = {n: w.detach().to(torch.bfloat16).clone() for n, w in weights.items()}

    def payload(self, weights, update):
        part = {}
        for n, w in weights.items():
            new = w.detach().to(torch.bfloat16)
            part[n] = wire.sparse_delta(tuple(w.shape), *sparse_delta.changed_elements(self.held[n], new),
                                        sync.checksum(self.held[n]), whole=lambda new=new: new)
            self.held[n] = new.clone()
        return sync.Payload(update, SEED, RANK, part, kind="sparse")


@pytest.mark.parametrize("optimizer", ["logra", "adam", "lora"])
def test_sparse_deltas_keep_engines_without_a_master_equal_to_the_trainer(optimizer):
    """60 updates of each optimizer sent as sparse deltas (LoRA's merged weights W + s B A), each
    through the wire format, to a bf16 engine in the HF layout and one in vLLM's fused layout,
    neither holding a residual: after every payload both equal bf16(trainer weights) element
    for element, and the deltas are a fraction of a full bf16 sync."""
    model = tiny_qwen2()
    targets = sketch.target_modules(model)
    if optimizer == "logra":
        layers = sketch.attach(model, rank=RANK, seed=SEED)
        opt = rowadam.RowAdam(layers, seed=SEED, update_ratio=1e-3)
    else:
        params = [m.weight for m in targets.values()]
        if optimizer == "lora":  # adapters A (r, k), B (d, r) beside frozen weights, B from zero
            g = torch.Generator().manual_seed(3)
            adapters = {n: (torch.nn.Parameter(torch.randn(RANK, m.in_features, generator=g) / m.in_features ** 0.5),
                            torch.nn.Parameter(torch.zeros(m.out_features, RANK))) for n, m in targets.items()}
            params = [p for a_b in adapters.values() for p in a_b]
            for m, (a, b) in zip(targets.values(), adapters.values()):
                m.weight.requires_grad_(False)
                m.register_forward_hook(lambda mod, x, y, a=a, b=b: y + 2.0 * (x[0] @ a.t()) @ b.t())
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95),
                                weight_decay=0.0)

    def weights():  # what the engines run: W, or LoRA's W + s B A
        if optimizer == "lora":
            return {n: torch.addmm(m.weight, adapters[n][1], adapters[n][0], alpha=2.0).detach()
                    for n, m in targets.items()}
        return {n: m.weight.detach() for n, m in targets.items()}

    hf = copy.deepcopy(model).to(torch.bfloat16)
    engines = [SparseEngineWeights(hf, base_seed=SEED, rank=RANK),
               SparseEngineWeights(vllm_standin(hf), base_seed=SEED, rank=RANK, layout="vllm", engine_layers=SEPARATE.engine)]
    start = sync.full_payload(weights(), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32)
    for e in engines:
        e.load_full(wire.decode(wire.encode(start)))  # fp32 rounded to bf16: no master kept
        assert e.state_bytes() == 0
    shadow = Shadow(weights())
    full = len(wire.encode(sync.full_payload(weights(), update=0, base_seed=SEED, rank=RANK)))
    shares, sizes = [], []
    for i in range(60):
        lm_loss(model, tiny_batch(seed=1000 + i)).backward()
        if optimizer == "logra":
            opt.prepare()
            opt.merge(1.0)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        now = weights()
        buf = wire.encode(shadow.payload(now, i))
        payload = wire.decode(buf)
        for e in engines:
            e.apply(payload)
        for n, w in now.items():
            ref = w.to(torch.bfloat16)
            for e in engines:
                assert torch.equal(engine_weight(e, n), ref), (optimizer, i, n)
        sync.check_fingerprints({n: sync.checksum(w.to(torch.bfloat16)) for n, w in now.items()},
                                engines[1].fingerprint())
        shares.append(sum(len(t.values) for t in payload.factors.values()) / sum(w.numel() for w in now.values()))
        sizes.append(len(buf))
    assert all(e.update == 60 for e in engines)
    assert 0 < max(shares) < 1 and sorted(sizes)[30] < full / 2, (shares, sizes, full)


def test_bad_sparse_deltas_are_refused_and_change_nothing():
    """A sparse delta is refused, and the engine left as it was, when it skips an update or
    comes twice, when it was made for other weights (the trainer skipped an update: the
    numbers agree, the base does not), when it is truncated or corrupted, or when it goes to
    an engine that merges factors; an engine without a master refuses factors."""
    model, layers, opt, engine_model = trainer(update_ratio=1e-3)
    engine = SparseEngineWeights(engine_model, base_seed=SEED, rank=RANK)
    engine.load_full(sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK))
    shadow = Shadow(masters(layers))
    payloads, factors, after = [], [], []
    for i in range(3):
        factors.append(step(model, layers, opt, i))
        payloads.append(shadow.payload(masters(layers), i))
        after.append({n: w.to(torch.bfloat16) for n, w in masters(layers).items()})
    engine.apply(payloads[0])
    snap = {n: engine_weight(engine, n).clone() for n in engine.slots}, engine.update

    def unchanged():
        assert engine.update == snap[1]
        assert all(torch.equal(engine_weight(engine, n), w) for n, w in snap[0].items())

    for bad, match in [(payloads[2], "skips"), (payloads[0], "duplicate")]:
        with pytest.raises(ValueError, match=match):
            engine.apply(bad)
        unchanged()
    # Update 2's changes renumbered as update 1: the engine would jump from update 0's weights
    # to 2's without 1's elements. The base (update 1's weights) is not what the engine holds.
    skipped = sync.Payload(1, SEED, RANK, payloads[2].factors, kind="sparse")
    with pytest.raises(ValueError, match="other weights than the engine holds"):
        engine.apply(wire.decode(wire.encode(skipped)))
    unchanged()
    good = wire.encode(payloads[1])
    corrupt = good.clone()
    corrupt[-20] ^= 0x10
    with pytest.raises(ValueError, match="checksum"):
        wire.decode(corrupt)
    with pytest.raises(ValueError, match="truncated|size mismatch"):
        wire.decode(good[:-16])
    with pytest.raises(ValueError, match="no fp32 master"):
        engine.apply(factors[1])
    unchanged()
    exact = StreamedEngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    with pytest.raises(ValueError, match="residuals behind"):
        exact.apply(payloads[0])
    with pytest.raises(ValueError, match="holds Sparse deltas"):
        wire.encode(sync.Payload(1, SEED, RANK, factors[1].factors, kind="sparse"))
    engine.apply(wire.decode(good))  # the right one still goes through
    assert engine.update == 2
    assert all(torch.equal(engine_weight(engine, n), after[1][n]) for n in engine.slots)


@pytest.mark.parametrize("layout", ["hf", "vllm"])
def test_sparse_deltas_with_nothing_changed(layout):
    """An update that changes no bf16 element of some targets (or of any) still travels as a
    sparse delta, an empty one for those, through the wire format, and leaves the engine's
    weights as they were; a half-written sparse update gives way to a full sync."""
    model = tiny_qwen2()
    hf = copy.deepcopy(model).to(torch.bfloat16)
    engine = SparseEngineWeights(hf if layout == "hf" else vllm_standin(hf), base_seed=SEED, rank=RANK,
                                 layout=layout, engine_layers=SEPARATE.engine)
    weights = {n: m.weight.detach().clone() for n, m in sketch.target_modules(model).items()}
    engine.load_full(sync.full_payload(weights, update=0, base_seed=SEED, rank=RANK))
    shadow = Shadow(weights)
    first = next(iter(weights))
    weights[first][0, :3] += 1.0  # three elements of one target change, nothing else
    for update, now in enumerate([weights, weights]):  # then an update that changes nothing at all
        buf = wire.encode(shadow.payload(now, update))
        payload = wire.decode(buf)
        assert [len(t.values) for t in payload.factors.values()] == [3 * (update == 0)] + [0] * (len(now) - 1)
        engine.apply(payload)
        for n, w in now.items():
            assert torch.equal(engine_weight(engine, n), w.to(torch.bfloat16)), (update, n)
    assert engine.update == 2
    # Half of update 2 written, then a full sync instead (the trainer resyncs): accepted.
    weights[first] -= 0.5
    part = shadow.payload(weights, 2)
    engine.apply(sync.Payload(2, SEED, RANK, {first: part.factors[first]}, kind="sparse"))
    engine.load_full(sync.full_payload(weights, update=3, base_seed=SEED, rank=RANK))
    assert engine.update == 3
    assert all(torch.equal(engine_weight(engine, n), w.to(torch.bfloat16)) for n, w in weights.items())


def _gather_on_two_ranks(rank, world, out_dir):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    before = torch.randn(7, 6, generator=g).to(torch.bfloat16)  # (d, k), d = 7: uneven rows 4 + 3
    result = []
    for case in ("both", "rank 0 only", "none"):
        after = before.clone()
        if case != "none":
            after[1, 2] += 1  # rank 0's rows
        if case == "both":
            after[4:, ::2] -= 1  # rank 1's rows
        lo, hi = (0, 4) if rank == 0 else (4, 7)
        result.append(sparse_delta.gather_changes(*sparse_delta.changed_elements(before[lo:hi], after[lo:hi], lo)))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_changes_gathered_from_row_shards_equal_the_whole_weights(tmp_path):
    """gather_changes on 2 gloo ranks, each holding its rows (uneven) of one weight: every rank
    gets the positions and values changed_elements finds on the whole weight, also when one
    rank or no rank has a change."""
    run_gloo(_gather_on_two_ranks, 2, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    g = torch.Generator().manual_seed(5)
    before = torch.randn(7, 6, generator=g).to(torch.bfloat16)
    for i, case in enumerate(("both", "rank 0 only", "none")):
        after = before.clone()
        if case != "none":
            after[1, 2] += 1
        if case == "both":
            after[4:, ::2] -= 1
        mask = (before.view(torch.int16) != after.view(torch.int16)).flatten()
        want = mask.nonzero().squeeze(1)  # the whole weight's changed positions, row-major
        assert len(want) == {"both": 1 + 9, "rank 0 only": 1, "none": 0}[case]
        for r in range(2):
            positions, values = got[r][i]
            assert torch.equal(positions, want) and torch.equal(values, after.flatten()[want]), (case, r)


@pytest.mark.parametrize("budget", [None, 2])  # a shape's targets stacked; each in row chunks
def test_batched_engine_merge_equals_the_reference(budget, monkeypatch):
    """infra/engine_weights.py's StreamedEngineWeights (the engines train.py starts; its factor
    merge is infra/batched.py's: signs made together, a shape's targets merged as one stack) holds
    bitwise sync.EngineWeights' masters and bf16 weights (one target at a time), over three
    updates, in both of its layouts; and the trainer's."""
    if budget is not None:
        monkeypatch.setattr(rowadam, "MERGE_ELEMENTS", budget)
    model, layers, opt, engine_model = trainer(update_ratio=1e-2)
    start = sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32)
    ref = sync.EngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    fast = [StreamedEngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK),
            StreamedEngineWeights(vllm_standin(copy.deepcopy(engine_model)), base_seed=SEED, rank=RANK, layout="vllm",
                                  engine_layers=SEPARATE.engine)]
    for e in (ref, *fast):
        e.load_full(start)
    for i in range(3):
        payload = wire.decode(wire.encode(step(model, layers, opt, i)))
        for e in (ref, *fast):
            e.apply(payload)
    for e in fast:
        assert ref.fingerprint() == e.fingerprint() and ref.update == e.update == 3
        for l in layers:
            assert torch.equal(ref.master(l.name), e.master(l.name))
            assert torch.equal(e.master(l.name), l.module.weight.detach()), l.name

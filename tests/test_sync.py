"""sync.py: engines that track the trainer bit for bit over 200 payloads, in both layouts."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config

import rowadam
import sketch
import sync
from distributed import run_gloo
from standin import vllm_standin
from tiny import tiny_batch, tiny_qwen2

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
    opt = rowadam.RowAdam(layers, base_seed=SEED, update_ratio=update_ratio)
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


def test_200_payloads_track_the_trainer_in_both_layouts():
    model, layers, opt, hf_engine_model = trainer()
    fused_model = vllm_standin(hf_engine_model)
    naive = {l.name: w.clone() for l, w in zip(layers, (l.module.weight.detach().to(torch.bfloat16) for l in layers))}
    engines = [sync.EngineWeights(hf_engine_model, base_seed=SEED, rank=RANK),
               sync.EngineWeights(fused_model, base_seed=SEED, rank=RANK, layout="vllm")]
    start = sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32)
    for e in engines:
        e.load_full(sync.decode(sync.encode(start)))  # start-up resync over the buffer path
    for i in range(200):
        payload = sync.decode(sync.encode(step(model, layers, opt, i)))
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


def test_bad_payloads_are_rejected_and_change_nothing():
    model, layers, opt, engine_model = trainer(update_ratio=1e-3)
    engine = sync.EngineWeights(engine_model, base_seed=SEED, rank=RANK)
    engine.load_full(sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32))
    payloads = [step(model, layers, opt, i) for i in range(4)]
    engine.apply(payloads[0])
    engine.apply(payloads[1])
    snap = snapshot(engine)
    with pytest.raises(ValueError, match="skips"):
        engine.apply(payloads[3])
    with pytest.raises(ValueError, match="duplicate"):
        engine.apply(payloads[1])
    good = sync.encode(payloads[2])
    corrupt = good.clone()
    corrupt[-5] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        sync.decode(corrupt)
    with pytest.raises(ValueError, match="truncated|size mismatch"):
        sync.decode(good[:-3])
    with pytest.raises(ValueError, match="truncated"):
        sync.decode(good[:40])
    with pytest.raises(ValueError, match="magic"):
        sync.decode(torch.zeros(64, dtype=torch.uint8))
    header = good.clone()
    header[20:24] = torch.tensor(list(b"}}}}"), dtype=torch.uint8)
    with pytest.raises(ValueError, match="malformed"):
        sync.decode(header)
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
    assert_unchanged(engine, snap)
    engine.apply(sync.decode(good))  # the right one still goes through
    assert engine.update == 3


def test_fused_row_offsets_for_real_configs():
    configs = {
        "Qwen2.5-Math-1.5B": Qwen2Config(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                         num_key_value_heads=2, num_hidden_layers=2),
        "Qwen2.5-Math-7B": Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                       num_key_value_heads=4, num_hidden_layers=2),
    }
    for cfg in configs.values():
        engine = sync.EngineWeights(vllm_standin(config=cfg, device="meta"), base_seed=0, rank=256, layout="vllm")
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
    sync.EngineWeights(model, base_seed=0, rank=8, layout="vllm")  # tensor parallel size 1: accepted
    model.model.layers[1].mlp.down_proj.tp_size = 2
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.down_proj: tensor-parallel"):
        sync.EngineWeights(model, base_seed=0, rank=8, layout="vllm")


def test_fused_weights_match_hf_layout_blocks():
    hf = tiny_qwen2().to(torch.bfloat16)
    fused = sync.EngineWeights(vllm_standin(hf), base_seed=0, rank=4, layout="vllm")
    plain = sync.EngineWeights(hf, base_seed=0, rank=4)
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
        sync.send(sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32), None, 1)
        for i in range(5):
            sync.send(step(model, layers, opt, i, trainers), None, 1)
            prints.append(sync.fingerprint(layers))
    else:
        engine = sync.EngineWeights(engine_model, base_seed=SEED, rank=RANK)
        engine.load_full(sync.recv(None, 0))
        for _ in range(5):
            engine.apply(sync.recv(None, 0))
            prints.append(engine.fingerprint())
    torch.save(prints, os.path.join(out_dir, f"fp{rank}.pt"))


def test_two_process_sync(tmp_path):
    run_gloo(_two_process, 2, str(tmp_path))
    trainer_fp, engine_fp = (torch.load(tmp_path / f"fp{r}.pt") for r in range(2))
    assert len(trainer_fp) == len(engine_fp) == 5
    for a, b in zip(trainer_fp, engine_fp):
        sync.check_fingerprints(a, b)
    assert trainer_fp[0] != trainer_fp[-1]  # the weights did move


def test_fingerprint_mismatch_names_the_layer():
    _, layers, _, engine_model = trainer()
    engine = sync.EngineWeights(engine_model, base_seed=SEED, rank=RANK)
    fp = engine.fingerprint()
    with torch.no_grad():
        engine.slots["model.layers.1.self_attn.v_proj"].param[3, 5] += 1.0
    with pytest.raises(RuntimeError, match="model.layers.1.self_attn.v_proj"):
        sync.check_fingerprints(fp, engine.fingerprint())
    # Checksums of row shards add up to the whole (FSDP2 fingerprints rely on it).
    w = torch.randn(37, 11).to(torch.bfloat16)
    parts = [sync._checksum_rows(w[:19], 0), sync._checksum_rows(w[19:], 19)]
    assert tuple(map(sum, zip(*parts))) == sync.checksum(w)


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
    engines = [sync.EngineWeights(hf, base_seed=SEED, rank=RANK),
               sync.EngineWeights(vllm_standin(hf), base_seed=SEED, rank=RANK, layout="vllm")]
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
        payload = sync.decode(sync.encode(sync.Payload(update, SEED, RANK, factors)))
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
    one = sync.EngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    streamed = sync.EngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    for i in range(3):  # move the trainer first
        step(model, layers, opt, i)
    weights = {n: w.clone() for n, w in masters(layers).items()}
    one.load_full(sync.full_payload(weights, update=3, base_seed=SEED, rank=RANK, dtype=torch.float32))
    groups = sync.layer_groups(weights)
    assert [len(g) for g in groups] == [7, 7] and groups[0][0].startswith("model.layers.0.")
    for n, names in enumerate(groups):
        part = sync.full_payload({k: weights[k] for k in names}, update=3, base_seed=SEED, rank=RANK,
                                 dtype=torch.float32)
        streamed.load_full(sync.decode(sync.encode(part)))
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
    one = sync.EngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    parts = sync.EngineWeights(copy.deepcopy(engine_model), base_seed=SEED, rank=RANK)
    start = sync.full_payload(masters(layers), update=0, base_seed=SEED, rank=RANK, dtype=torch.float32)
    one.load_full(start)
    parts.load_full(start)
    payloads = [step(model, layers, opt, i) for i in range(2)]
    for p in payloads:
        one.apply(p)
        first, second = sync.layer_groups(p.factors)
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

"""Trainer and engine on one GPU (`--gpus 1`, infra/one_gpu.py), on this CPU at tiny widths: the
engine's weights cast from the trainer's master are, bit for bit, what a factor-merging engine
holds after the same updates (and why: the trainer's masters have no bf16 ties); the engine's
bf16 copy made a tensor at a time is copy.deepcopy's cast; train.py's rows with --gpus 1 are
the factor sync's but for the bytes sent, times and memory, its output check passes and a
resume ends bitwise where the run ended; the one-GPU plan's refusals (7B AdamW, 27B) in one
line, exit 2."""

import copy
import json
import shutil

import pytest
import torch

import in_process
import sketch
import sync
from infra import engine_sync, one_gpu, planning, policy
from infra.batched import BatchedRowAdam
from infra.engine import HFEngine
from infra.options import OptionError
from subproc import read_checkpoint

WIDTHS = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=32, tie_word_embeddings=False)
SEED, RANK = 3, 8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()


@pytest.mark.parametrize("tied", [False, True])
def test_the_engine_copy_is_the_deep_copys_cast(tied):
    model = policy.build_model(dict(WIDTHS, tie_word_embeddings=tied), 18, 0)
    want, got = copy.deepcopy(model).to(torch.bfloat16), policy.engine_copy(model)
    a = {**dict(want.named_parameters()), **dict(want.named_buffers())}
    b = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied  # ties kept, as the config says


def test_cast_weights_equal_the_factor_merged_ones_after_every_update():
    """Five LoGRA updates of a tiny Qwen2 (RowAdam at a large step, so that most updates move
    bf16 values): after each, an engine refreshed by one_gpu.refresh holds bit for bit what
    sync.EngineWeights (the reference) and infra/engine_weights.py's engine (train.py's) hold
    after merging the same factors; a bf16 engine that merges without a residual does not."""
    torch.manual_seed(0)
    model = policy.build_model(WIDTHS, 18, SEED)
    engines = [HFEngine(policy.engine_copy(model), base_seed=SEED, sketch_rank=RANK, eos=2, pad=0, exact=exact)
               for exact in (True, False)]
    reference_model = policy.engine_copy(model)
    reference = sync.EngineWeights(reference_model, base_seed=SEED, rank=RANK)
    naive = policy.engine_copy(model)  # bf16 weights, F A subtracted in bf16: no master
    layers = sketch.attach(model, rank=RANK, seed=SEED)
    modules = sketch.target_modules(model)
    for e in engines:  # ties avoided on the trainer, its fp32 master loaded (train.py's start)
        engine_sync.start(e, model, modules, optimizer="logra", mode="factors", update=0, seed=SEED, rank=RANK)
    reference.load_full(sync.full_payload({n: m.weight for n, m in modules.items()}, update=0, base_seed=SEED,
                                          rank=RANK, dtype=torch.float32))
    opt = BatchedRowAdam(layers, seed=SEED, update_ratio=3e-2)
    g = torch.Generator().manual_seed(1)
    moved, naive_differs = [], 0
    for update in range(5):
        ids = torch.randint(3, 18, (4, 16), generator=g)
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.prepare()
        before = {n: m.weight.detach().to(torch.bfloat16) for n, m in modules.items()}
        factors = opt.merge(1.0)
        engine_sync.factors(engines[0], layers, factors, update=update, seed=SEED, rank=RANK)
        reference.apply(sync.Payload(update, SEED, RANK, {l.name: f for l, f in zip(layers, factors)}))
        assert one_gpu.refresh(engines[1], modules, update=update) == 0  # no bytes sent
        naive_weights = sketch.target_modules(naive)
        with torch.no_grad():
            for layer, f in zip(layers, factors):  # bf16 W -= bf16(F A), rounded every update
                w = naive_weights[layer.name].weight
                w.copy_((w.float() - (f.float() @ layer.projection_as(torch.float32))).to(torch.bfloat16))
        cast = {n: s.weight for n, s in engines[1].weights.slots.items()}
        for name, module in modules.items():
            want = module.weight.detach().to(torch.bfloat16)  # bf16 of the trainer's master: the cast
            assert torch.equal(bits(cast[name]), bits(want)), (update, name)
            assert torch.equal(bits(engines[0].weights.slots[name].weight), bits(want)), (update, name)
            assert torch.equal(bits(reference.slots[name].weight), bits(want)), (update, name)
            assert torch.equal(reference.master(name), module.weight.detach())  # the masters themselves
            naive_differs += int((bits(naive_weights[name].weight) != bits(want)).sum())
        moved.append(sum(int((bits(before[n]) != bits(cast[n])).sum()) for n in modules))
        layers_sync = engine_sync.fingerprint(model, "logra")
        sync.check_fingerprints(layers_sync, engines[1].fingerprint())
        assert engines[1].weights.update == update + 1
    assert all(m > 0 for m in moved) and naive_differs > 0, (moved, naive_differs)


def test_the_factor_engines_split_is_the_cast_only_off_bf16_ties():
    """The relation, on the fp32 words themselves: sync.store_master's bf16 part is round to
    nearest even wherever the master is off a bf16 tie; on a tie it rounds toward zero where
    nearest-even rounds away (the trainer's rowadam.avoid_bf16_ties_ moves every tie first, so
    no master the two engines hold has one)."""
    words = torch.tensor([0x3F808000, 0x3F818000, -0x40C08000 + 2**32, 0x3F818001, 0x3F817FFF], dtype=torch.int64)
    master = words.to(torch.int32).view(torch.float32)  # ties on the first three (low 16 bits 0x8000)
    hi, lo = torch.empty(5, dtype=torch.bfloat16), torch.empty(5, dtype=torch.int16)
    sync.store_master(master.clone(), hi, lo)
    cast = master.to(torch.bfloat16)
    assert (bits(hi) != bits(cast)).tolist() == [False, True, True, False, False]
    tie_free = rowadam_avoid(master.clone())
    sync.store_master(tie_free.clone(), hi, lo)
    assert torch.equal(bits(hi), bits(tie_free.to(torch.bfloat16)))


def rowadam_avoid(w):
    import rowadam

    return rowadam.avoid_bf16_ties_(w)


# A few small updates from the tiny preset's base policy (conftest.runs), as tests/test_train.py's SMALL.
SMALL = ["--batch", "8", "--eval-problems", "16", "--eval-every", "0", "--rank", "8", "--check-outputs", "1"]
DIFFER = {"sync_bytes", "mem_gib", "tokens_per_s", "time_s"}  # the bytes sent; the process's memory; times


@pytest.mark.parametrize("optimizer", ["logra", "adam", "lora"])
def test_a_one_gpu_run_is_the_synced_run_but_for_its_bytes_and_times(runs, optimizer):
    """train.py --gpus 1 on the tiny preset (this CPU as its one device): every row equals the
    run that syncs its engine (LoGRA's factors; AdamW's and LoRA's full bf16 weights) but for
    the bytes sent (0), the times and the process's memory; the output check ran after every
    sync (--check-outputs 1) and passed; config.json records the layout, --checkpointing's
    choice and the plan's figure."""
    factor, cast = runs / f"one-gpu-{optimizer}-synced", runs / f"one-gpu-{optimizer}-cast"
    in_process.run([*SMALL, "--updates", "2", "--optimizer", optimizer, "--run-dir", str(factor)])
    out = in_process.run([*SMALL, "--updates", "2", "--optimizer", optimizer, "--gpus", "1", "--run-dir", str(cast)])
    a = [json.loads(line) for line in open(factor / "metrics.jsonl")]
    b = [json.loads(line) for line in open(cast / "metrics.jsonl")]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        same = lambda row: {k: v for k, v in row.items() if k not in DIFFER and not k.startswith("time_")}  # noqa: E731
        assert same(x) == same(y)
    assert all(r["sync_bytes"] == 0 for r in b[1:]) and all(r["sync_bytes"] > 0 for r in a[1:])
    saved = json.load(open(cast / "config.json"))
    assert saved["gpus"] == 1 and saved["checkpointing"] is False and saved["plan_gib"] > 0
    assert json.load(open(factor / "config.json"))["plan_gib"] is None  # a CPU run plans nothing
    name = {"logra": "LoGRA", "adam": "AdamW", "lora": "LoRA"}[optimizer]
    assert f"memory plan: checkpointing off; {name}'s update {saved['plan_gib']:.2f} GiB" in out.stdout


def test_a_one_gpu_run_resumes_bitwise(runs):
    """--gpus 1 resumed from checkpoint-2 (its engine's weights cast from the loaded master)
    ends bitwise where the uninterrupted 3-update run ended, with the same rows."""
    d = runs / "one-gpu-resume"
    in_process.run([*SMALL, "--updates", "3", "--gpus", "1", "--save-every", "1", "--run-dir", str(d)])
    again = runs / "one-gpu-resumed"
    shutil.copytree(d, again)
    in_process.run([*SMALL, "--updates", "3", "--gpus", "1", "--save-every", "1", "--resume", str(again),
                    "--resume-from", "checkpoint-2"])
    full, resumed = read_checkpoint(d, "checkpoint-3"), read_checkpoint(again, "checkpoint-3")
    for part in ("model", "optimizer"):
        x, y = torch.utils._pytree.tree_leaves(full[part]), torch.utils._pytree.tree_leaves(resumed[part])
        assert len(x) == len(y) and all(torch.equal(p, q) if torch.is_tensor(p) else p == q for p, q in zip(x, y))
    rows = lambda path: [{k: v for k, v in json.loads(line).items() if k not in DIFFER and not k.startswith("time_")}
                         for line in open(path / "metrics.jsonl")]  # noqa: E731
    assert rows(d) == rows(again)


def test_bad_one_gpu_requests_are_refused_in_one_line(runs, tmp_path):
    """--gpus 2, --sync delta or --engine vllm with --gpus 1, two torchrun ranks, a chat preset,
    and a GPU too small for the plan (--gpu-memory): exit 2, one line, nothing written."""
    never = tmp_path / "never"
    for argv, words in [(["--gpus", "2"], "--gpus 2: 1 is the layout it sets"),
                        (["--gpus", "1", "--sync", "delta"], "--sync delta: with --gpus 1"),
                        (["--gpus", "1", "--engine", "vllm"], "--gpus 1 runs the in-process Hugging Face engine"),
                        (["--gpus", "1", "--gpu-memory", "0.001"], "--gpus 1: LoGRA's update plans"),
                        (["--model", "7b", "--gpus", "1"], "--gpus 1 runs the arithmetic task's presets")]:
        out = in_process.run([*argv, "--run-dir", str(never)], check=False)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, (argv, out.stderr)
        assert not never.exists()
    out = in_process.run(["--gpus", "1", "--run-dir", str(never)], check=False, WORLD_SIZE="2")
    assert out.returncode == 2 and "--gpus 1 runs one process and torchrun started 2" in out.stderr


def test_the_one_gpu_dry_run_plans_7b_and_refuses_what_does_not_fit():
    """--dry-run --gpus 1 at 7B and 27B: the plan for an 80 GB and a 141 GB GPU; LoGRA's 7B
    fits both (checkpointing off); AdamW's 7B is refused with its figure, its state and what
    fits instead; at 27B every method is refused, the fp32 master's 100 GiB named."""
    out = in_process.run(["--model", "7b-random", "--dry-run"])
    assert "| an 80 GB GPU (74.51 GiB) | " in out.stdout and "| a 141 GB GPU (131.32 GiB) | " in out.stdout
    assert "memory plan: checkpointing auto -> off; LoGRA's update" in out.stdout
    adam = in_process.run(["--model", "7b-random", "--dry-run", "--optimizer", "adam"], check=False)
    assert adam.returncode == 2 and adam.stderr.count("\n") == 1 and "| an 80 GB GPU" in adam.stdout
    assert "--gpus 1: AdamW's update plans 139.79 GiB on one GPU" in adam.stderr
    assert "AdamW's state 72.93 GiB" in adam.stderr and "LoGRA's plans 53.24 GiB" in adam.stderr
    for optimizer in ("logra", "adam"):
        big = in_process.run(["--model", "27b", "--gpus", "1", "--dry-run", "--optimizer", optimizer], check=False)
        assert big.returncode == 2 and "the trainer's fp32 master 100.26 GiB" in big.stderr, big.stderr
        assert "more than the GPU alone" in big.stderr and "no method fits one GPU" in big.stderr
    small = in_process.run(["--model", "7b-random", "--dry-run", "--gpu-memory", "60"])
    assert "| --gpu-memory 60 (60.00 GiB) | 53.24 / 61.80 -> on |" in small.stdout


def test_auto_checkpointing_follows_the_plan_at_7b():
    """settle_memory at 7b-random's shapes (the plan on the meta device): off where the update
    fits the GPU without checkpointing, on where only with it, refused where neither; the
    choice and the plan's figure are what config.json records."""
    import dataclasses
    import train

    cfg = dataclasses.replace(train.PRESETS["7b-random"], preset="7b-random", checkpointing="auto")
    plan = planning.run_plan(cfg, 1)
    for gib, choice, figure in [(74, False, 61.80), (60, True, 53.24)]:
        settled, line = planning.settle_memory(cfg, 1, gib * 2**30, plan=plan)
        assert settled.checkpointing is choice and round(settled.plan_gib, 2) == figure, (gib, settled.plan_gib)
        assert settled.record()["checkpointing"] is choice and f"{figure:.2f} GiB" in line
    with pytest.raises(OptionError, match="LoGRA's update plans 53.24 GiB"):
        planning.settle_memory(cfg, 1, 50 * 2**30, plan=plan)
    explicit = dataclasses.replace(cfg, checkpointing=True)
    assert planning.settle_memory(explicit, 1, 74 * 2**30, plan=plan)[0].checkpointing is True

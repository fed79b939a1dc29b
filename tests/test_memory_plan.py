"""The memory plan (memory_plan.py): the 7B plan against the shapes counted by hand, the
paper's targets for it, the engines of --sync delta and of full weights against the 7B and 27B
shapes, the estimate against the tensors measured on 2 gloo ranks, and a local checkpoint's
plan built from its own config.json."""

import contextlib
import io
import json
import math
import os
import sys
from unittest import mock

import pytest
import torch

import tiny_families
import tiny_math
import train
from infra import architectures, memory_plan
from subproc import ROOT


def test_dry_run_7b_memory_against_shapes():
    m = memory_plan.estimate(train.PRESETS["7b"].model, 4, 256)
    h, i, q, kv, layers = 3584, 18944, 3584, 512, 28
    rows = layers * (q + kv + kv + h + i + i + h)  # sum of d over the targets (all divisible by 4)
    cols = layers * (h + h + h + q + h + h + i)  # sum of k over the targets
    # Row-sharded S (and U): a quarter of the rows per rank; A as int8 signs, whole on every rank.
    assert m["logra_sketches"] == 4 * (rows // 4) * 256 and m["logra_projections"] == 256 * cols
    gib = 2**30
    # The targets of the 7B run: LoGRA's state beyond the fp32 weight shard <= 1 GiB, and so
    # is its optimizer step's transient; the engine keeps a KV cache of >= 16 GiB on 80 GB.
    assert m["trainer_logra_persistent_bytes"] - m["weights"] <= 1.0 * gib
    assert m["trainer_logra_transient_bytes"] <= 1.0 * gib
    # The probe's attention, one decoder layer at a time (infra/probe_decoder.py's written_decoder): 2 responses x
    # 28 heads x 4096^2 scores, 10 bytes each in bf16 at its peak (the fp32 softmax P, the bf16 dS
    # and one fp32 temporary: P dS, then dP), and the (2, 1, T, T) mask.
    assert m["trainer_probe_attention_bytes"] == 2 * 28 * 4096**2 * 10 + 2 * 4096**2 * 2
    # The probe runs after backward, when the training activations are gone: the trainer's peak
    # is its state with the larger of the two, within an 80 GB GPU at 7B and at 27B.
    peak = lambda p: p["trainer_logra_bytes"] + max(p["trainer_activation_bytes"],  # noqa: E731
                                                   p["trainer_probe_activation_bytes"])
    assert peak(m) < 40 * gib
    assert m["engine_kv_cache_bytes"] >= 16 * gib and not m["engine_residual_on_host"]
    # vLLM 0.34's own memory, from the widths: a 16384-token step's MLP activations (3 I + 3 h
    # bf16 values a token) outweigh the sampler's 1024 rows of logits (10 bytes a vocab entry);
    # then the (1024, V) int32 token counts, the graph pool and the context.
    step = 2 * 16384 * (3 * 18944 + 3 * 3584)
    assert step > 1024 * 152064 * 10
    assert m["engine_overhead_bytes"] == step + 4 * 1024 * 152064 + gib // 2 + gib
    assert m["engine_residual_bytes"] == 2 * m["target_params"]  # int16 per target weight
    # The 27B preset does not fit dense AdamW's state on an 80 GB GPU; LoGRA's does, and its
    # engines fit the same node with their residuals in host memory.
    m27 = memory_plan.estimate(train.PRESETS["27b"].model, 4, 256)
    assert m27["trainer_adam_persistent_bytes"] > 80e9
    assert peak(m27) < 80e9
    assert m27["engine_residual_on_host"] and m27["engine_kv_cache_bytes"] >= 16 * gib
    assert m27["engine_gpu_bytes"] + m27["engine_kv_cache_bytes"] < 80e9


@pytest.mark.parametrize("preset", ["7b", "27b"])
def test_delta_and_full_sync_engines_against_shapes(preset):
    """The engines of --sync delta and of full bf16 weights keep no residual, and --sync
    delta's trainer a bf16 shadow of its rows: every count from the preset's model built on the
    meta device, its seven projections summed per decoder layer. The delta engine's KV cache is
    the factor engine's plus the residual it kept on the GPU less the larger transfer buffer,
    and at 27B the factor engine's residuals in host memory are gone."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**train.PRESETS[preset].model))
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    per_layer = [[m.weight.shape for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] in names]
                 for layer in model.model.layers]
    assert all(len(shapes) == 7 for shapes in per_layer)
    shapes = [s for layer in per_layer for s in layer]
    layer_entries = max(sum(d * k for d, k in layer) for layer in per_layer)  # d k of one decoder layer
    biggest = max(d * k for d, k in shapes)
    weights = 2 * sum(p.numel() for p in model.parameters())  # bf16 on the engine
    residual = 2 * sum(d * k for d, k in shapes)  # int16 per target weight
    check = 16 * min(2**20, biggest)  # the base checksum's int64 work (infra/checksum.py's CHECK_WORDS words)
    widths = train.PRESETS[preset].model  # vLLM 0.34's own memory, as the 7B test counts it
    gib = 2**30
    overhead = 2 * 16384 * 3 * (widths["intermediate_size"] + widths["hidden_size"]) + 4 * 1024 * 152064 + gib * 3 // 2
    m = memory_plan.estimate(train.PRESETS[preset].model, 4, 256)

    # Every element of one layer changed: 2 B a bf16 value, 1/8 B of bitmap, 8 B a decoded
    # position, and the larger of the checksum's work and the position code's (80 B x 2^20).
    delta = math.ceil(layer_entries * (2 + 1 / 8 + 8)) + max(check, 80 * 2**20)
    assert m["engine_delta_transfer_bytes"] == delta
    assert m["engine_delta_gpu_bytes"] == weights + delta  # no residual
    assert m["engine_delta_kv_cache_bytes"] == 80 * 10**9 - weights - delta - overhead
    assert m["engine_delta_reserve_bytes"] == delta + gib
    full = 2 * layer_entries + check  # one layer in bf16
    assert m["engine_full_gpu_bytes"] == weights + full
    assert m["engine_full_kv_cache_bytes"] == 80 * 10**9 - weights - full - overhead
    assert m["engine_full_reserve_bytes"] == full + gib
    # Rank 0's rows of every target in bf16. Transient: the layer's gathered changes (10 B an
    # element) and the larger of one target's gather (new rows 2 B, mask 1 B, its changes and
    # their padded copy 10 B each per element of its rows, every rank's 10 B per element of
    # the weight) and the encoding (the bitmap's bool bits of the largest weight, the layer's
    # blobs and payload at 2 + 1/8 B an element each, the largest weight's bitmap once more,
    # 64 B for each of 2^20 positions coded at a time).
    assert m["trainer_delta_shadow_bytes"] == 2 * sum(-(-d // 4) * k for d, k in shapes)
    gather = max(23 * -(-d // 4) * k + 10 * d * k for d, k in shapes)
    encoding = 2 * math.ceil(layer_entries * (2 + 1 / 8)) + math.ceil(biggest / 8) + 64 * 2**20
    transient = 10 * layer_entries + max(gather, encoding)
    assert m["trainer_delta_sync_transient_bytes"] == transient
    assert m["trainer_lora_delta_sync_transient_bytes"] == transient + 8 * layer_entries + 8 * biggest

    on_gpu = 0 if m["engine_residual_on_host"] else residual
    assert m["engine_residual_bytes"] == residual and (preset == "27b") == m["engine_residual_on_host"]
    gain = m["engine_delta_kv_cache_bytes"] - m["engine_kv_cache_bytes"]
    assert gain == on_gpu - (delta - m["engine_transfer_bytes"])
    assert m["engine_host_bytes"] == residual - on_gpu and (preset == "7b" or m["engine_host_bytes"] > 0)
    lines = memory_plan.describe(m, preset=preset, checkpoint="-", sketch_rank=256, micro_batch=2, context=4096,
                                 cuda=True)
    [line] = [x for x in lines if x.startswith("engine GPU with --sync delta")]
    assert "no residual" in line
    assert f"KV cache {m['engine_delta_kv_cache_bytes'] / gib:.2f} GiB" in line
    assert f"{'+' if gain >= 0 else '-'}{abs(gain) / gib:.2f} GiB against the factor sync's" in line
    assert "host 0.00 GiB" in line and ("pinned host memory" in line) == (preset == "27b")


def test_memory_estimate_matches_measured_tensors():
    """bench/memory_check.py at a small size: on 2 gloo ranks with FSDP2, the LoGRA and AdamW
    tensors each rank holds (persistent) and allocates in the optimizer step (transient, by
    phase) are within 5% of memory_plan.estimate for the same shapes."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import memory_check

    small = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, tie_word_embeddings=False)
    rows, probe = memory_check.measure(small, 64)
    print("\n".join(f"{label}: {got} / {want} = {got / want:.3f}" for label, got, _, want in rows))
    for label, got, other, want in rows:
        assert abs(got / want - 1) <= 0.05, (label, got, want)
        assert got == other or "persistent" not in label  # both ranks hold the same (d divisible by 2)
    assert probe[0] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [512, 1024])
def test_the_probes_count_against_its_live_bytes(dtype, tokens):
    """The KL probe's planned peak (its forward's activations and tangents with the eager
    attention's scores, and its buffers) against the live tensor bytes of infra/probe_decoder.py's fast_probe,
    counted by a dispatch mode (a CPU torch records no allocator peak), at small widths and long
    sequences, where the (B, H, T, T) attention terms dominate as they do at 2 x 4096 tokens.
    The output head runs after the decoder, its chunk is not part of this peak."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from memory_check import LiveBytes
    import sketch
    from infra.probe_decoder import fast_probe
    from transformers import Qwen2Config, Qwen2ForCausalLM

    widths = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=128, max_position_embeddings=tokens)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**widths)).to(dtype).requires_grad_(False)
    r, batch = 8, 2
    layers = sketch.attach(model, rank=r, seed=0)
    directions = [torch.randn(layer.module.weight.shape[0], r) * 1e-3 for layer in layers]
    ids = torch.randint(0, 128, (batch, tokens))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    with LiveBytes([*model.parameters(), *model.buffers(), *directions]) as live:
        fast_probe(model, layers, directions, ids, mask, max_responses=batch, max_tokens=tokens)
    c = torch.finfo(dtype).bits // 8
    plan = memory_plan.estimate(widths, 1, r, context=tokens, probe_forward_tokens=batch * tokens,
                                kl_real_positions=0, compute_bytes=c)
    d_max = k_max = 128
    planned = plan["trainer_probe_activation_bytes"] + 4 * d_max * r + 8 * r * k_max  # gathered U, A
    assert plan["trainer_probe_attention_bytes"] > 0.7 * planned  # the regime of the 7B probe (80% there)
    assert 0.85 * planned <= live.peak <= 1.02 * planned, (live.peak, planned)


# Two regimes of the training step's activations at small widths: the output head's backward the
# largest transient (a vocabulary 42 times the width, as Qwen2.5-7B's 152064 / 3584), and a decoder
# layer's (a small vocabulary, a wide MLP).
REGIMES = {"head": dict(hidden_size=64, intermediate_size=336, num_attention_heads=4, num_key_value_heads=1,
                        vocab_size=2688),
           "layer": dict(hidden_size=64, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                         vocab_size=32)}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_activation_count_against_the_tensors_a_step_keeps(regime, dtype):
    """memory_plan.activations against the live tensor bytes of train.py's training step (the
    forward, ppo.response_logprobs and policy_loss, backward) counted by a dispatch mode, for
    LoGRA, AdamW and LoRA, with activation checkpointing of every decoder layer and without:
    what the forward leaves for backward within 0.6% (the loss's own (B, T) terms, not counted),
    and backward's peak within 3% (a little is freed before the peak that the count keeps)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from memory_check import LiveBytes
    import ppo
    import sketch
    from infra import policy
    from transformers import Qwen2Config, Qwen2ForCausalLM

    widths = dict(REGIMES[regime], num_hidden_layers=3, max_position_embeddings=128, tie_word_embeddings=False)
    batch, tokens, r = 2, 128, 8
    c = torch.finfo(dtype).bits // 8
    plan = memory_plan.estimate(widths, 1, r, micro_batch=batch, context=tokens, compute_bytes=c, cuda=False)
    for method in ("logra", "adam", "lora"):
        for checkpointing in (False, True):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(Qwen2Config(**widths)).to(dtype)
            policy.freeze_for(model, method, sketch_rank=r, lora_alpha=32.0, seed=0)
            if checkpointing:
                architectures.enable_checkpointing(model)
            if method == "logra":
                sketch.attach(model, rank=r, seed=0)
            grads = [p for p in model.parameters() if p.requires_grad]
            for p in grads:  # AdamW's and LoRA's gradients are their state (the plan's adam_grads), not activations
                p.grad = torch.zeros_like(p)
            ids = torch.randint(3, widths["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(ids, dtype=torch.bool)
            mask[:, :4] = False
            with LiveBytes([*model.parameters(), *model.buffers(), *(p.grad for p in grads), ids]) as live:
                logp = ppo.response_logprobs(model(input_ids=ids, use_cache=False).logits, ids)
                loss, _ = ppo.policy_loss(logp, torch.tensor([1.0, -1.0]), mask, rollout_logprobs=logp.detach(),
                                          num_tokens=int(mask.sum()))
                del logp
                held = live.live()
                live.peak = 0
                loss.backward()
                del loss
            key = "on" if checkpointing else "off"
            want_held, want_peak = plan["trainer_activations_held"][method][key], plan["trainer_activations"][method][key]
            print(f"{regime} {dtype} {method} checkpointing {key}: held {held} / {want_held}, "
                  f"peak {live.peak} / {want_peak}")
            assert abs(held / want_held - 1) <= 0.006, (method, key, held, want_held)
            assert abs(live.peak / want_peak - 1) <= 0.03, (method, key, live.peak, want_peak)
    # What the plan says at 7B (one rank, 2 x 4096 tokens): without checkpointing LoGRA keeps P, not X, and
    # holds less than AdamW; with it, every method keeps the layers' inputs alone.
    m = memory_plan.estimate(train.PRESETS["7b"].model, 1, 256, micro_batch=2, context=4096)
    acts = m["trainer_activations"]
    assert acts["logra"]["off"] < acts["adam"]["off"] < acts["lora"]["off"]
    assert m["trainer_activations_held"]["logra"]["on"] == m["trainer_activations_held"]["adam"]["on"]


@pytest.mark.slow
def test_update_cost_runs_at_tiny_widths():
    """bench/update_cost.py at the tiny width on this CPU: both methods run every phase of an
    update in their own process, LoGRA's payload is the smaller, its realised KL and probe are
    measured, its state is the smaller, and the table names the scaled train phase. (Its GPU
    counterpart is the device check's depth7b step: tests/test_gpu_check.py.)"""
    import json
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "update_cost.py"), "--widths", "tiny",
                          "--reps", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results = {r["method"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    logra, adam = results["logra"], results["adam"]
    assert {"probe", "realised KL", "prepare", "merge", "engine's merge"} <= set(logra["times"])
    assert {"step", "engine's load"} <= set(adam["times"])
    assert all(t > 0 for r in (logra, adam) for t in r["times"].values())
    assert logra["payload"] < adam["payload"] and logra["state"] < adam["state"]
    assert logra["params"] == adam["params"] > 0
    assert "x16" in out.stdout and "LoGRA / AdamW" in out.stdout


@pytest.mark.parametrize("family", sorted(architectures.ARCHITECTURES))
def test_dry_run_plans_a_local_checkpoint_from_its_own_config(family, tmp_path):
    """`train.py --model tiny-math --model-path DIR --dry-run` on a tiny checkpoint of each
    family (tests/tiny_families.py: a vocabulary of 128, pad_token_id 0): the plan's model is
    built from DIR's whole config.json, so that it plans, and it counts the parameters that
    DIR's weights hold. Built from the widths alone, with transformers' defaults, Phi-3's took
    Phi3Config's pad_token_id 32000 and no embedding of 128 (or 300) rows could be built
    (issue 32, item 8)."""
    folder = tmp_path / "model"
    tiny_families.model(family).save_pretrained(folder)  # untied: the file holds every parameter
    train_path, eval_path = tiny_math.write_data(str(tmp_path), *tiny_math.problems(0))
    argv = ["--model", "tiny-math", "--model-path", str(folder), "--train-data", train_path,
            "--eval-data", eval_path, "--context", "64", "--dry-run"]  # the family's 64 positions
    out = io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(out):
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)
        plan = train.run([*argv, "--json"])
        train.run(argv)
    printed, text = out.getvalue().split("\n", 1)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the weights in DIR: the reference
        weights = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    assert plan["params"] == json.loads(printed)["params"] == weights > 0
    assert f"checkpoint {folder}" in text and "layout: 1 node x 1 training rank" in text

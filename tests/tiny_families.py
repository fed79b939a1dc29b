"""Tiny models of every family in architectures.py, built from local configs (no download), and
one family's trainer followed by a vLLM CPU engine: shared by tests/test_architectures.py,
tests/test_vllm_engine.py and bench/architectures.py."""

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import rowadam
import sketch
import sync
from infra import architectures
from infra import engine_sync

VOCAB = 128
BOS, EOS, PAD = 1, 2, 0
GAP_MEAN, GAP_MAX = 2e-2, 0.25  # bf16 engine vs fp32 trainer, per token: the suite's bounds


def config(model_type, tied=False):
    """A 2-layer model of the family: hidden 64, intermediate 96, 2 query heads of 32 and one
    KV head (GQA; head_dim 32 for vLLM's CPU attention), small token ids."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=BOS,
              eos_token_id=EOS, pad_token_id=PAD)
    if model_type != "phi3":  # Phi-3 derives head_dim from hidden_size / heads (32 here)
        kw["head_dim"] = 32
    return AutoConfig.for_model(model_type, **kw)


def model(model_type, tied=False, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(model_type, tied), dtype=torch.float32).eval()


class Fused(nn.Module):
    """A vLLM layer as sync.EngineWeights sees it: one weight of row blocks, their sizes."""

    def __init__(self, weight, output_sizes):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.output_sizes = list(output_sizes)


# How vLLM holds a decoder layer's projections, read from its model files (qwen2.py, llama.py,
# gemma2.py, phi3.py: QKVParallelLinear [q; k; v], MergedColumnParallelLinear [gate; up]),
# written here independently of architectures.py, whose rows the tests check against it.
VLLM_ROWS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
             "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def vllm_layout(hf_model):
    """The engine's layers as vLLM holds them, bf16, from the Hugging Face model's weights:
    each fused vLLM layer the row blocks of its parts in vLLM's order, or the Hugging Face
    layer itself where that is fused already (Phi-3)."""
    root = nn.Module()
    for i, layer in enumerate(architectures.decoder_layers(hf_model)):
        named = {n.rsplit(".", 1)[-1]: (n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        for vllm_name, parts in VLLM_ROWS.items():
            held = (vllm_name,) if vllm_name in named else parts
            parent = named[held[0]][0].rsplit(".", 1)[0]  # self_attn or mlp
            weights = [named[p][1].weight.detach().to(torch.bfloat16) for p in held]
            holder = root
            for part in f"model.layers.{i}.{parent}".split("."):
                if not hasattr(holder, part):
                    holder.add_module(part, nn.Module())
                holder = getattr(holder, part)
            holder.add_module(vllm_name, Fused(torch.cat(weights).clone(), [w.shape[0] for w in weights]))
    return root


def follow_with_vllm(model_type, folder, *, tied=False, updates=3, seed=3, rank=8) -> dict:
    """The family's tiny model saved to `folder` and served by a vLLM CPU engine (no tokenizer:
    token ids in and out); the trainer's fp32 master resynced, then `updates` LoGRA updates
    (sketches, RowAdam, merge) whose bf16 factors the engine merges itself, fingerprints
    compared after every sync; then the engine's samples and log-probs against a float64
    recomputation of the trainer. Returns the measures."""
    from infra import vllm_engine  # vLLM is imported by the engine process only

    trainer = model(model_type, tied)
    arch = architectures.check_layers(trainer)
    trainer.save_pretrained(folder)
    with torch.no_grad():
        for m in sketch.target_modules(trainer).values():
            rowadam.avoid_bf16_ties_(m.weight.mul_(1.0 + 1e-3))  # off the checkpoint: the resync has work to do
    t0 = time.perf_counter()
    eng = vllm_engine.VLLMEngine(model_path=folder, context=64, seed=seed, sketch_rank=rank, gpu=None, device="cpu",
                            log_path=os.path.join(folder, "engine.log"), timeout=300, gpu_memory_utilization=0.1,
                            eos=EOS, pad=PAD)
    started = time.perf_counter() - t0
    try:
        modules = sketch.target_modules(trainer)
        for names in engine_sync.layer_groups(modules):
            eng.load_full(sync.full_payload({n: modules[n].weight for n in names}, update=0, base_seed=seed,
                                            rank=rank, dtype=torch.float32))
        sync.check_fingerprints(sync.fingerprint(trainer), eng.fingerprint())
        layers = sketch.attach(trainer, rank=rank, seed=seed)
        opt = rowadam.RowAdam(layers, seed=seed, update_ratio=1e-3)
        g = torch.Generator().manual_seed(7)
        sent = []
        for update in range(updates):
            ids = torch.randint(3, VOCAB, (4, 9), generator=g)
            logits = trainer(input_ids=ids).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.prepare()
            factors = opt.merge(1.0)
            sent.append(eng.apply(sync.Payload(update, seed, rank, {l.name: f for l, f in zip(layers, factors)})))
            sync.check_fingerprints(sync.fingerprint(layers), eng.fingerprint())  # raises on any difference
        prompts = torch.randint(3, VOCAB, (8, 6), generator=g).tolist()
        ro = eng.generate(prompts, list(range(8)), temperature=1.0, max_new_tokens=12)
        sketch.detach(trainer)
        with torch.no_grad():
            out = trainer(input_ids=ro.ids).logits.double()
        logp = torch.log_softmax(out[:, :-1], -1).gather(-1, ro.ids[:, 1:, None]).squeeze(-1)
        ref = torch.cat([torch.zeros(ro.ids.shape[0], 1, dtype=logp.dtype), logp], 1)
        gap = (ro.logprobs.double() - ref).abs()[ro.mask]
        if not (gap.mean() < GAP_MEAN and gap.max() < GAP_MAX):  # the bounds of the other engine tests
            raise AssertionError(f"{model_type}: engine/trainer log-prob gap mean {gap.mean():.2e}, max "
                                 f"{gap.max():.2e} (bounds {GAP_MEAN}, {GAP_MAX})")
        return {"targets": len(modules), "start_s": started, "factor_bytes": max(sent),
                "gap_mean": gap.mean().item(), "gap_max": gap.max().item(), "tokens": gap.numel()}
    finally:
        eng.close()


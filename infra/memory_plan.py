"""
infra/memory_plan.py: what every buffer of a run takes per GPU, from the model's shapes alone.

What it is
----------
`estimate(model_cfg, world, sketch_rank, ...)` builds the model of `model_cfg` on the meta
device (no memory, no GPU) and counts, per training GPU under `world`-way FSDP2 and per
engine GPU, the bytes of every persistent buffer and of the largest transient of each phase
of the optimizer step, for LoGRA and for dense AdamW; `peak` and `fits` say whether an update
fits a GPU, with activation checkpointing or without, its engine beside it or not.
`describe(plan, ...)` turns the counts
into the lines `python train.py --model 7b --dry-run` prints. The counts are checked against
measured allocations in bench/memory_check.py and tests/test_train_paper_path.py (to 5%).

Where the model's config comes from
-----------------------------------
`model_cfg` is a plain dict, made into its family's config as `from_pretrained` makes a
checkpoint's: every entry given, transformers' defaults for the rest, Qwen2 when it names no
`model_type`. A run with a local checkpoint (`--model-path DIR`) passes the whole of DIR's
config.json (planning.run_plan, planning.checkpoint_config), so that the plan's model is the
checkpoint's own: its family, widths, biases and token ids (a Phi-3 of 300 tokens whose
config.json says pad_token_id 0 is not rebuilt with Phi3Config's default, 32000, which no
300-row embedding can hold). A run without one (a hub id, the 1.5b/7b/27b presets' built-in
widths, the tiny presets) passes its preset's widths, train.PRESETS[name].model.

The paper's Table 1 (arXiv:2610.06647) reports whole-run averages per GPU (7B: 31.82 GiB for
dense Adam, 17.29 GiB for LoGRA); this plan counts the state and the step's transients from
the shapes, so that every buffer at that scale is accounted for before a GPU is rented.

Assumptions, numbered
---------------------
1. GPUs of 80 GB (the paper's H100 80GB, `GPU_BYTES`); vLLM's own overhead besides weights
   and KV cache (activations, CUDA graphs, context) is counted as vLLM 0.34 sizes it
   (`engine_overhead`: 4.1 GiB at 7B, 5.1 GiB at 27B), read from its source, not measured on a
   GPU (the device check has no vLLM).
2. An engine that merges LoGRA's factors (`--sync factors`) keeps the exact-merge residuals
   (2 bytes per target weight) on its GPU when the KV cache keeps at least 16 GiB there, else
   in pinned host memory (27B). An engine that receives the changed bf16 elements (`--sync
   delta`) or full bf16 weights (AdamW's and LoRA's default, `--sync full`) keeps none; the
   delta's transfer buffer is counted for its worst case, every element of one decoder layer
   changed, and the trainer keeps a bf16 shadow of its rows of every target instead.
3. Activations (`activations`) are counted with non-reentrant activation checkpointing of
   every decoder layer and without, for each method (LoGRA keeps P = X A^T, AdamW X), from
   what autograd keeps in the Hugging Face Qwen2/Llama layer with SDPA attention, in bf16
   compute (`compute_bytes`; measured to 0.6% at small widths: tests/test_memory_plan.py),
   with FSDP2 prefetching one decoder layer ahead. `peak` is a method's planned peak with
   either; --checkpointing auto (planning.settle_memory) takes the faster one that `fits`.
4. The KL probe (kl_control.py) forms the attention's (B, H, T, T) softmax and its tangent one
   decoder layer at a time. Its written-out decoder (Qwen2, Qwen3, Llama, Mistral:
   `infra/probe_decoder.written_decoder`, whose primal attention is torch's fused kernel) holds at most
   10 bytes a score entry in bf16 compute (12 in fp32): the fp32 softmax P, the bf16 dS and one
   fp32 temporary (P dS, then dP); forward-mode AD through transformers' eager attention (the
   other families) about 24 (20 in fp32; Gemma 2, which caps its scores, two more). At 7B and
   2 x 4096 tokens that is 8.8 GiB, most of the probe's peak; the training forward runs SDPA
   and holds none of it.
5. --gpus 1 (`phases`, `peak(one_gpu=True)`): the trainer and the in-process engine on one
   GPU; the engine's bf16 weights (no residual) and its generation (a bf16 KV cache of the
   rollout's prompts at the full context, the sampler's fp32 rows of logits) beside the
   trainer, the generation a phase of its own (it runs before training's activations exist).
"""

import inspect

import torch

import kl_control
import ppo
import rowadam
import sketch
from infra import batched, probe_decoder
from infra.checksum import CHECK_WORDS
from infra.engine_sync import FACTOR_PAYLOAD_BYTES
from infra.sparse_delta import CODE_CHUNK
from sync import CHECK_MOD

GPU_BYTES = 80 * 10**9  # the paper's H100 80GB (assumption 1)
TABLE2 = {"1.5b": (13.21, 7.18)}  # the paper's Table 2: average GiB per GPU, LoRA and LoGRA at rank 256
# vLLM 0.34's own memory on an engine GPU besides weights and KV cache (assumption 1), as its GPU
# worker sizes the KV cache: an offline LLM on an H100/H200 schedules 16384 tokens and 1024
# sequences a step (engine/arg_utils.py), and its profile run and sizing warm-up hold the larger
# of one step's activations and the sampler's work on 1024 rows of logits; besides them a
# persistent int32 (1024, V) count of output tokens (penalties), the CUDA graphs' pool (51
# capture sizes up to 512; logs show 0.3-0.6 GiB), and the CUDA context, cuBLAS and NCCL.
VLLM_STEP_TOKENS, VLLM_MAX_SEQS = 16384, 1024
VLLM_GRAPH_POOL = 2**29
VLLM_CONTEXT = 2**30  # context, cuBLAS and NCCL workspaces, compiled kernels
ENGINE_MARGIN = 2**30  # kept free on an engine GPU beyond what the plan counts
MIN_KV_CACHE = 16 * 2**30  # residuals go to host memory below this KV cache (assumption 2)


def engine_overhead(h: int, inter: int, vocab: int, compute_bytes: int = 2) -> int:
    """vLLM 0.34's bytes on an engine GPU besides weights and KV cache, from the widths (the
    constants above): the larger of one step's MLP activations (its gate and up projections, 2I,
    their product, I, and three hidden-width copies a token) and the sampler's (bf16 logits,
    their fp32 copy and log-probs), the token counts, the graph pool and the context."""
    step = compute_bytes * VLLM_STEP_TOKENS * (3 * inter + 3 * h)
    sampler = VLLM_MAX_SEQS * vocab * (compute_bytes + 4 + 4)
    return max(step, sampler) + 4 * VLLM_MAX_SEQS * vocab + VLLM_GRAPH_POOL + VLLM_CONTEXT


METHODS = ("logra", "adam", "lora")
NAMES = {"logra": "LoGRA", "adam": "AdamW", "lora": "LoRA"}
LOGPROB_CHUNK = inspect.signature(ppo.response_logprobs).parameters["chunk"].default  # positions in fp32 at a time


def activations(config, *, micro_batch: int, context: int, rank: int, compute_bytes: int = 2, fsdp: bool = True,
                layer_params: int = 0) -> dict:
    """The training forward's and backward's activation bytes of one micro-batch (micro_batch x
    context tokens, N) for each method, with activation checkpointing of every decoder layer
    ("on") and without ("off"), counted from what autograd keeps (assumption 3; measured:
    tests/test_memory_plan.py). {"held": {method: {"on", "off"}}, "peak": {...}}: held, what
    the forward leaves for backward; peak, held with the largest transient of backward.

    A decoder layer keeps, a token: each RMSNorm's fp32 input and 1/rms (2 (4 h + 4)); the
    attention's q and output, k and v (c (2 q + 2 kv)) and its fp32 log-sum-exp a head (4 H);
    the MLP's gate and up outputs and the SiLU's (3 c I); and what the targets need for their
    weights' gradients: LoGRA P = X A^T a target (7 c r, no X: sketch.py), AdamW the inputs X
    (c h for q, k, v; c h for gate, up; c I for down; o_proj's is the attention's output
    itself), LoRA those X and its X A^T (7 c r). AdamW's and LoRA's first layer keeps no
    RMSNorm input (nothing before it has a gradient); LoGRA's embedding output requires one
    (sketch.attach's hook), and autograd keeps that leaf (c h; in fp32 compute it is the first
    RMSNorm's input). With checkpointing a layer keeps only its input (c h) and backward
    recomputes one layer at a time. After the layers: the final RMSNorm's (4 h + 4), the
    logits (c V) and the fp32 log-probs (4; ppo.response_logprobs keeps no fp32 copy of the
    logits); RoPE's cos and sin (2 c T D).
    Backward's largest transient is the output head's or one decoder layer's: a chunk of
    LOGPROB_CHUNK positions' logits in fp32 four times (the fp32 logits, / temperature, and
    their two gradients) plus the logits' gradient (c V a token) accumulated over chunks when
    there are several; or the MLP's three (N, I) gradients (less AdamW's and LoRA's X of
    down_proj, freed by then), with the recomputed layer under checkpointing. FSDP2 (`fsdp`)
    gathers two bf16 decoder layers (`layer_params` parameters each), one prefetched.
    """
    c, r, tokens = compute_bytes, rank, micro_batch * context
    h, inter, vocab, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    shared = 2 * (4 * h + 4) + c * (2 * q + 2 * kv) + 4 * heads + 3 * c * inter  # every method's, a token
    inputs = c * (2 * h + inter)  # the targets' X: q/k/v, gate/up, down (o_proj's: the attention's output)
    kept = {"logra": 7 * c * r, "adam": inputs, "lora": inputs + 7 * c * r}
    # layer 0: AdamW's and LoRA's RMSNorm keeps nothing; LoGRA's embedding output, a leaf, is kept
    first = {"logra": -c * h if c < 4 else 0, "adam": 4 * h + 4, "lora": 4 * h + 4}
    head = tokens * (4 * h + 4 + c * vocab + 4) + 2 * c * context * head_dim
    positions = context - 1  # the log-probs score positions 1..T-1
    chunk = min(positions, LOGPROB_CHUNK)
    head_backward = 4 * 4 * micro_batch * chunk * vocab + \
        (c * micro_batch * positions * vocab if positions > chunk else 0)
    in_flight = 2 * 2 * layer_params if fsdp else 0
    held, peak = {}, {}
    for m in METHODS:
        layer = tokens * (shared + kept[m])  # one decoder layer's saved tensors
        layer_backward = (3 if m == "logra" else 2) * c * tokens * inter
        held[m] = {"off": layers * layer - tokens * first[m] + head, "on": layers * c * tokens * h + head}
        peak[m] = {"off": held[m]["off"] + max(head_backward, layer_backward) + in_flight,
                   "on": held[m]["on"] + max(head_backward, layer + layer_backward) + in_flight}
    return {"held": held, "peak": peak}


def estimate(model_cfg: dict, world: int, sketch_rank: int, *, micro_batch: int = 2, context: int = 4096,
             probe_forward_tokens: int = 2 * 4096, kl_real_positions: int = 256, compute_bytes: int = 2,
             gpu_bytes: int = GPU_BYTES, cuda: bool = True, rollout_batch: int = 128) -> dict:
    """Per-GPU bytes of a run under `world`-way FSDP2 at sketch rank `sketch_rank`, from the
    shapes, for training process 0 (it holds the largest shard). `probe_forward_tokens`: the
    tokens of the KL probe's forward pass (the paper's 2 responses of up to 4096 tokens).
    `model_cfg`: a checkpoint's whole config.json, or a preset's widths (the module docstring).

    Trainer, persistent: fp32 weight shards; AdamW's fp32 gradient and two moments per target
    row held; LoGRA's row shards of S, U (n, r) and v (n,), and the int8 signs of A (r, k).
    Trainer, transient in the optimizer step: AdamW's one fp32 temporary per target (foreach)
    and a streamed full sync (one decoder layer gathered in fp32, cast, encoded); LoGRA's
    factors F (n, r) plus the largest of prepare's per-layer float64 work, the probe's
    gathered U and head chunk, the merge's float64 chunk and the streamed factor sync. LoRA
    (lora.py): the adapters A, B with their gradients and moments, AdamW's temporary or the
    streamed sync of merged weights.
    Activations (micro-batch x context, activation checkpointing): layer inputs kept, one
    layer recomputed, the bf16 weights of two layers in flight, the logits.
    Engines (one per GPU), by what they receive; what remains of `gpu_bytes` after their bf16
    weights, their buffers and vLLM's overhead is the KV cache, and what the sync adds on the
    GPU (its buffers, residuals there, a margin) is reserved from vLLM. Factors ("engine_*"):
    the int16 residuals of the exact merge (on the GPU when the KV cache keeps at least 16 GiB,
    else in pinned host memory), one decoder layer's fp32 transfer buffer and merge chunk.
    Changed elements (--sync delta, "engine_delta_*"): no residual; one decoder layer's
    payload and decoded positions, every element changed at worst. Full bf16 weights
    ("engine_full_*"): no residual; one decoder layer's bf16 payload. With --sync delta each
    trainer GPU also keeps a bf16 shadow of its rows of every target ("trainer_delta_*").
    Activations: `activations`, each method with and without checkpointing (`cuda`: bf16
    compute under FSDP2, whose layers in flight count; else FSDP2 only with world > 1).
    One GPU (--gpus 1, `one_gpu`): the step's transients without a sync payload ("*_cast_*"),
    and the in-process engine's generation of `rollout_batch` prompts ("one_gpu_generate_bytes").
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    # The model's own family (its targets' shapes: Phi-3's are fused), Qwen2 without a
    # model_type; every entry of model_cfg, as from_pretrained would read a config.json. The
    # widths below are the config's, so that an entry left out takes the family's default in
    # the counts as it does in the model.
    entries = {k: v for k, v in model_cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(model_cfg.get("model_type", "qwen2"), **entries)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    r = sketch_rank
    ceil = lambda n: -(-n // world)  # noqa: E731  (rows of process 0: FSDP2 chunks dim 0)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    weights = 4 * sum(ceil(p.shape[0]) * (p.numel() // p.shape[0]) for p in params)
    shapes = [m.weight.shape for m in sketch.target_modules(model).values()]
    targets = sum(d * k for d, k in shapes)
    layers = config.num_hidden_layers
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    target_rows = sum(ceil(d) * k for d, k in shapes)  # target weight entries held by process 0
    n_sum = sum(ceil(d) for d, _ in shapes)  # rows of S, U, v held by process 0
    d_max, k_max = max(d for d, _ in shapes), max(k for _, k in shapes)
    layer_targets = targets // layers
    layer_rows = sum(d for d, _ in shapes) // layers

    adam_state = 4 * target_rows + 8 * target_rows  # grad + exp_avg + exp_avg_sq
    # LoRA (lora.py): A (r, k) and B (d, r) per target, row-sharded like every weight; each
    # adapter entry holds its fp32 value, gradient and two moments. Its step's transient: one
    # fp32 temporary per adapter entry, or the streamed sync of merged weights (AdamW's, plus
    # one target's gathered A and B).
    lora_rows = sum(ceil(r) * k + ceil(d) * r for d, k in shapes)
    lora_state = 16 * lora_rows
    # one decoder layer gathered in fp32, cast to bf16 and encoded, and full_tensor's all-gather
    # buffer and copy of the largest weight
    full_sync_bytes = 8 * layer_targets + 8 * max(d * k for d, k in shapes)
    adam_transient = max(4 * target_rows, full_sync_bytes)
    logra_state = 4 * n_sum * r * 2 + 4 * n_sum + r * sum(k for _, k in shapes)  # S, U, v, signs
    factors = 2 * n_sum * r  # F (n, r) bf16, until the sync has sent it
    # prepare: ||W||^2 summed a layer at a time in float64 blocks of batched.SUM_BLOCK entries;
    # A A^T of a batch of layers of one shape from their signs in fp32 (the stacked signs, their
    # fp32 copy, the fp32 Gram and its two float64 copies); then D, D (A A^T) and their product
    # in float64 beside the Gram (measured: bench/memory_check.py)
    counts = {}  # target shapes (rows held, k) and how many layers have each
    for d, k in shapes:
        counts[ceil(d), k] = counts.get((ceil(d), k), 0) + 1
    # layers of one shape whose Gram matrices A A^T prepare forms at once, and whose merge is one batch
    gram_batch = {s: min(c, max(1, batched.GRAM_ELEMENTS // (r * s[1]))) for s, c in counts.items()}
    merge_batch = {s: min(c, rowadam.MERGE_ELEMENTS // (s[0] * s[1])) for s, c in counts.items()}
    prepare = max(max(8 * min(batched.SUM_BLOCK, n * k),  # ||W||^2 in float64 blocks
                      # a batch's stacked signs and their fp32 copy, fp32 Gram and its two float64 copies; then
                      # D, D (A A^T) and their product in float64 beside the Gram
                      g * (5 * r * k + 20 * r * r), g * (8 * r * r + 24 * n * r))
                  for (n, k), g in gram_batch.items())
    # The probe is a forward pass with tangents over the first responses (after backward: the
    # training activations are gone): its activations and tangents, and the hook's P and dY,
    # are counted as activations; its own buffers are one layer's gathered U, A formed in
    # fp32 and one output-head chunk.
    head = min(probe_decoder.HEAD_CHUNK_BYTES, probe_forward_tokens * probe_decoder.BYTES_PER_VOCAB_ENTRY * vocab)
    probe = 4 * d_max * r + 8 * r * k_max + head
    probe_activations = compute_bytes * probe_forward_tokens * (2 * (4 * h + 2 * kv + 4 * inter) + r + d_max)
    # The probe's attention is eager (kl_control.probe_mode: SDPA's fused kernels have no forward
    # AD), one decoder layer at a time: per score entry of its (B, H, T, T) the scores and their
    # tangent (2 c), their fp32 copies for the softmax (8, none in fp32 compute), the softmax and
    # the two (B, H, T, T) temporaries of its tangent (12); and the (B, 1, T, T) additive mask
    # (assumption 4; measured: tests/test_memory_plan.py).
    seq = min(context, kl_control.MAX_TOKENS, probe_forward_tokens)
    mask = -(-probe_forward_tokens // seq) * seq * seq  # (B, 1, T, T) entries
    if config.model_type in probe_decoder.WRITTEN_OUT:  # probe_decoder.written_decoder: fp32 P and dP, dS
        per_entry = 8 + compute_bytes
    else:  # forward-mode AD through the model's own eager attention
        per_entry = 2 * compute_bytes + (8 if compute_bytes < 4 else 0) + 12
    probe_attention = mask * config.num_attention_heads * per_entry + mask * compute_bytes
    # The merge (batched.merge_layers), per shape: layers whose MERGE_ELEMENTS entries fit stacked (their
    # W copy, F A in float64 and its fp32 rounding, A in float64 and F in float64), a larger layer
    # in chunks of rows (A in float64, a chunk's F and F A in float64 and fp32); then the signs of
    # A_{t+1}, made in batches of batched.SIGN_BATCH words (int64 work and its sign table lookup).
    words = {}  # hashed words of A's signs per width: r ceil(k / 16) a layer
    for (n, k), c in counts.items():
        words[k] = words.get(k, 0) + c * r * -(-k // sketch.SIGNS_PER_WORD)
    sign_words = max(min(w, max(batched.SIGN_BATCH, r * -(-k // sketch.SIGNS_PER_WORD))) for k, w in words.items())
    merge = max(max((16 * L * n * k + 8 * L * r * k + 8 * L * n * r) if L >= 2 else
                    (8 * r * k + 12 * min(rowadam.rows_per_chunk(k), n) * k + 8 * n * r)
                    for (n, k), L in merge_batch.items()),
                56 * sign_words)
    # one payload's gathered F (one decoder layer's, or as many as fit in FACTOR_PAYLOAD_BYTES),
    # then the larger of its encoded payload and the checksum's work (infra/checksum.py: a block of
    # words as int64, and the int64 column sums and their weights)
    words = min(CHECK_WORDS, d_max * r)
    payload = 2 * layer_rows * r * max(1, min(layers, FACTOR_PAYLOAD_BYTES // (2 * layer_rows * r)))
    factor_sync_bytes = payload + max(payload, 8 * words + 16 * CHECK_MOD)
    # The realised KL: the probe keeps the policy's logits at its first positions (compute
    # dtype) until after the merge; then the same positions' new logits and one block of
    # float64 work (kl_control.KL_CHUNK_POSITIONS positions of two log-softmaxes and a product).
    kl_real = compute_bytes * kl_real_positions * vocab
    kl_real_work = kl_real + 32 * min(kl_real_positions, kl_control.KL_CHUNK_POSITIONS) * vocab if kl_real else 0
    phases = {"prepare": prepare, "probe": probe + kl_real, "merge": factors + merge, "sync": factor_sync_bytes}
    logra_transient = max(prepare, probe + kl_real, kl_real + factors + max(merge, factor_sync_bytes, kl_real_work))
    acts = activations(config, micro_batch=micro_batch, context=context, rank=r, compute_bytes=compute_bytes,
                       fsdp=cuda or world > 1, layer_params=layer_targets + 2 * h)
    lora_transient = max(4 * lora_rows, full_sync_bytes + 4 * r * (d_max + k_max))  # LoRA's X A^T: as P
    # --gpus 1 (infra/one_gpu.py): no payload, the engine's weights cast from the master a target at a
    # time (LoRA's merged weight formed in fp32 first); the in-process engine's generation: its bf16
    # KV cache (k and v of every layer for rollout_batch x context tokens, and one layer's once more
    # while the cache grows), and per prompt the bf16 logits of the last position and at most eight
    # fp32 (B, V) temporaries of the sampler (infra/engine.py's Gumbel-max draw)
    logra_cast_transient = max(prepare, probe + kl_real, kl_real + factors + max(merge, kl_real_work))
    cast_transients = {"logra": logra_cast_transient, "adam": 4 * target_rows,
                       "lora": max(4 * lora_rows, 4 * max(d * k for d, k in shapes))}
    kv_cache = 2 * 2 * kv * rollout_batch * context * (layers + 1)
    generate = kv_cache + rollout_batch * vocab * (2 + 8 * 4)

    engine_weights = 2 * total
    overhead = engine_overhead(h, inter, vocab, compute_bytes)
    residual = 2 * targets
    # fp32 layer payload, a merge chunk (rowadam.MERGE_ELEMENTS entries: bf16 + int16, fp32 master,
    # F A in float64 and fp32), A in float64
    transfer = 4 * layer_targets + 20 * rowadam.MERGE_ELEMENTS + 16 * r * k_max
    kv_on_gpu = gpu_bytes - engine_weights - residual - transfer - overhead
    on_host = kv_on_gpu < MIN_KV_CACHE
    engine_gpu = engine_weights + transfer + (0 if on_host else residual)
    # Checking a target's base checksum (infra/checksum.py) before a write: its int64 words and
    # their weights, in blocks of at most CHECK_WORDS words
    check_work = 16 * min(CHECK_WORDS, max(d * k for d, k in shapes))
    # --sync full (and AdamW's and LoRA's default): one decoder layer's bf16 payload
    full_transfer = 2 * layer_targets + check_work
    # --sync delta, every element of one decoder layer changed at worst (one payload a decoder
    # layer): the payload's bf16 values and positions (the smaller code is at most the bitmap,
    # 1/8 byte an element), the positions decoded as int64, and the larger of the base
    # checksum's work and the position code's (CODE_CHUNK bytes at a time: the bitmap's
    # bits as uint8 and bool and the int64 positions found, 80 bytes a byte; a gaps-coded
    # target has at most 1/8 as many positions as elements, so that its varints' ends and its
    # positions take less than a bitmap-coded target's positions)
    code_work = 80 * CODE_CHUNK
    delta_transfer = 2 * layer_targets + -(-layer_targets // 8) + 8 * layer_targets + max(check_work, code_work)
    # The delta's trainer: the bf16 shadow of its rows of every target (what the engines hold).
    # Transient, every entry changed at worst: the layer's gathered positions (int64) and values
    # (bf16), held until its payload is encoded, and on top of them the larger of one target's
    # gather (its new bf16 rows, change mask, own and padded changes; every rank's changes
    # gathered, d k) and the encoding (the layer's blobs and its payload, the largest weight's
    # position code once more while it joins its blob, and the code's work: CODE_CHUNK
    # positions at a time, 64 bytes each at most).
    delta_shadow = 2 * target_rows
    gather = max((2 + 1 + 10 + 10) * ceil(d) * k + 10 * d * k for d, k in shapes)
    encoding = (2 * (2 * layer_targets + -(-layer_targets // 8)) + -(-max(d * k for d, k in shapes) // 8)
                + 64 * CODE_CHUNK)
    delta_sync_bytes = 10 * layer_targets + max(gather, encoding)
    return {
        "params": total, "target_params": targets, "layers": layers, "world": world, "sketch_rank": r,
        "weights": weights, "adam_grads": 4 * target_rows, "adam_moments": 8 * target_rows,
        "logra_sketches": 4 * n_sum * r, "logra_directions": 4 * n_sum * r, "logra_moments": 4 * n_sum,
        "logra_projections": r * sum(k for _, k in shapes),
        "trainer_adam_bytes": weights + adam_state + adam_transient,
        "trainer_adam_persistent_bytes": weights + adam_state, "trainer_adam_transient_bytes": adam_transient,
        "trainer_logra_phases": phases,
        "trainer_logra_bytes": weights + logra_state + logra_transient,
        "trainer_logra_persistent_bytes": weights + logra_state, "trainer_logra_transient_bytes": logra_transient,
        "lora_adapters": 4 * lora_rows, "lora_grads": 4 * lora_rows, "lora_moments": 8 * lora_rows,
        "trainer_lora_bytes": weights + lora_state + lora_transient,
        "trainer_lora_persistent_bytes": weights + lora_state, "trainer_lora_transient_bytes": lora_transient,
        # activations of one micro-batch, each method with checkpointing on and off (`activations`); the
        # largest with checkpointing, the figure of every method before --checkpointing
        "trainer_activations": acts["peak"], "trainer_activations_held": acts["held"],
        "trainer_activation_bytes": max(acts["peak"][m]["on"] for m in METHODS),
        "trainer_probe_activation_bytes": probe_activations + probe_attention,
        "trainer_probe_attention_bytes": probe_attention,
        "engine_gpu_bytes": engine_gpu, "engine_weight_bytes": engine_weights, "engine_residual_bytes": residual,
        "engine_residual_on_host": on_host, "engine_transfer_bytes": transfer,
        "engine_kv_cache_bytes": gpu_bytes - engine_gpu - overhead, "engine_overhead_bytes": overhead,
        "engine_host_bytes": residual if on_host else 0,
        "engine_reserve_bytes": (0 if on_host else residual) + transfer + ENGINE_MARGIN,
        "engine_delta_gpu_bytes": engine_weights + delta_transfer, "engine_delta_transfer_bytes": delta_transfer,
        "engine_delta_kv_cache_bytes": gpu_bytes - engine_weights - delta_transfer - overhead,
        "engine_delta_reserve_bytes": delta_transfer + ENGINE_MARGIN,
        "engine_full_gpu_bytes": engine_weights + full_transfer, "engine_full_transfer_bytes": full_transfer,
        "engine_full_kv_cache_bytes": gpu_bytes - engine_weights - full_transfer - overhead,
        "engine_full_reserve_bytes": full_transfer + ENGINE_MARGIN,
        "trainer_delta_shadow_bytes": delta_shadow, "trainer_delta_sync_transient_bytes": delta_sync_bytes,
        # LoRA's delta sync forms the merged weights too, as its full sync does
        "trainer_lora_delta_sync_transient_bytes": full_sync_bytes + delta_sync_bytes,
        "gpu_bytes": gpu_bytes,
        **{f"trainer_{m}_cast_transient_bytes": b for m, b in cast_transients.items()},
        "one_gpu_generate_bytes": generate, "one_gpu_kv_cache_bytes": kv_cache, "rollout_batch": rollout_batch,
        "micro_batch": micro_batch, "context": context,
    }


# -----------------------------------------------------------------------------
# A method's peak, and whether it fits: --checkpointing auto and --gpus 1 (planning.py)

# A plan fits a GPU where FIT_MARGIN times its peak is within the GPU's memory: the device check's
# measured peaks ran up to 4.1% over the plan (bench/results/gpu_check/gpu_check-27f6fff.json, depth7b:
# LoGRA 46.09 GiB against 44.28), and the allocator keeps some memory it does not hand out.
FIT_MARGIN = 1.05


def phases(plan: dict, method: str, checkpointing: bool, one_gpu: bool = False) -> dict:
    """What a training GPU holds beyond its persistent state in each phase of the update, by
    name: training's activations (with or without `checkpointing`), the step's transients
    (LoGRA's KL probe runs after backward; its transients are added to every phase, as
    memory_model.peak adds them); with `one_gpu` (--gpus 1) the engine's generation too, and
    the step's transients without a sync payload."""
    act = plan["trainer_activations"][method]["on" if checkpointing else "off"]
    transient = plan[f"trainer_{method}_{'cast_' if one_gpu else ''}transient_bytes"]
    found = {f"training's activations ({plan['micro_batch']} x {plan['context']} tokens)": act}
    if method == "logra":
        found["the KL probe's forward"] = plan["trainer_probe_activation_bytes"]
    else:
        found["the optimizer step"] = transient
    if one_gpu:
        found[f"the engine's generation ({plan['rollout_batch']} prompts x {plan['context']} tokens)"] = \
            plan["one_gpu_generate_bytes"]
    return {k: v + transient for k, v in found.items()} if method == "logra" else found


def peak(plan: dict, method: str, checkpointing: bool, one_gpu: bool = False) -> int:
    """A training GPU's planned peak for `method`: its persistent state and its largest phase
    (`phases`); `one_gpu` (--gpus 1): the engine's bf16 weights beside them."""
    engine = plan["engine_weight_bytes"] if one_gpu else 0
    largest = max(phases(plan, method, checkpointing, one_gpu).values())
    return plan[f"trainer_{method}_persistent_bytes"] + engine + largest


def fits(peak_bytes: int, gpu_bytes: float) -> bool:
    """Whether a planned peak fits a GPU of `gpu_bytes` (FIT_MARGIN)."""
    return FIT_MARGIN * peak_bytes <= gpu_bytes


def checkpointing_for(plan: dict, method: str, gpu_bytes: float, one_gpu: bool = False) -> bool:
    """--checkpointing auto: off where the update fits the GPU without it (recomputing no
    forward, the faster setting), else on."""
    return not fits(peak(plan, method, False, one_gpu), gpu_bytes)


def describe(plan: dict, *, preset: str, checkpoint: str, sketch_rank: int, micro_batch: int, context: int,
             cuda: bool, layout: str = None) -> list[str]:
    """The dry run's lines: the sharding plan, a Markdown table of the trainer's memory per GPU
    (AdamW and LoGRA), activations, the engine GPU, and `layout`: which GPU runs what."""
    gib = 2**30
    g = lambda key: f"{plan[key] / gib:.2f} GiB"  # noqa: E731
    acts = plan["trainer_activations"]
    world = plan["world"]
    gain = plan["engine_delta_kv_cache_bytes"] - plan["engine_kv_cache_bytes"]  # KV cache over the factor sync's
    gone = " (no residuals in pinned host memory)" if plan["engine_residual_on_host"] else ""
    lines = [
        f"preset {preset}: {plan['params'] / 1e9:.2f}B parameters ({plan['target_params'] / 1e9:.2f}B in the seven "
        f"target projections), checkpoint {checkpoint}",
        f"sharding: FSDP2 over {world} training ranks, {plan['layers']} decoder-layer units + the root "
        f"(embedding, final norm, lm_head); every weight row-sharded (rank i holds rows [i*ceil(d/{world}), ...)), "
        f"and so are LoGRA's S, U and v; "
        + ("bf16 compute, fp32 master weights and gradient reduction" if cuda else "fp32"),
        f"per training GPU, rank {sketch_rank}, micro-batch {micro_batch} x {context} tokens (estimates from the "
        f"shapes):",
        "| | weights (fp32 shard) | gradients | optimizer state | sketches + directions | projections "
        "| persistent | step transient | total |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| AdamW | {g('weights')} | {g('adam_grads')} | {g('adam_moments')} | - | - "
        f"| {g('trainer_adam_persistent_bytes')} | {g('trainer_adam_transient_bytes')} | {g('trainer_adam_bytes')} |",
        f"| LoGRA | {g('weights')} | - | {plan['logra_moments'] / gib:.4f} GiB (row moments) "
        f"| {(plan['logra_sketches'] + plan['logra_directions']) / gib:.2f} GiB | {g('logra_projections')} "
        f"(int8 signs) | {g('trainer_logra_persistent_bytes')} | {g('trainer_logra_transient_bytes')} "
        f"| {g('trainer_logra_bytes')} ({plan['trainer_logra_bytes'] / plan['trainer_adam_bytes']:.2f}x) |",
        f"| LoRA | {g('weights')} | {g('lora_grads')} | {g('lora_moments')} | {g('lora_adapters')} (adapters A, B) "
        f"| - | {g('trainer_lora_persistent_bytes')} | {g('trainer_lora_transient_bytes')} "
        f"| {g('trainer_lora_bytes')} ({plan['trainer_lora_bytes'] / plan['trainer_adam_bytes']:.2f}x) |",
        "activations of one micro-batch with activation checkpointing / without (LoGRA keeps P = X A^T a target, "
        "AdamW and LoRA X; infra/memory_plan.activations): " + ", ".join(
            f"{name} {acts[m]['on'] / gib:.2f} / {acts[m]['off'] / gib:.2f} GiB" for m, name in NAMES.items())
        + f"; the KL probe's forward with tangents {g('trainer_probe_activation_bytes')} (after backward; "
        f"{g('trainer_probe_attention_bytes')} of it the eager attention's scores and softmax with their tangents, "
        f"one layer at a time)",
        "a training GPU's peak with checkpointing / without: " + ", ".join(
            f"{name} {peak(plan, m, True) / gib:.2f} / {peak(plan, m, False) / gib:.2f} GiB"
            for m, name in NAMES.items()),
        f"engine GPU ({plan['gpu_bytes'] / 1e9:.0f} GB): bf16 weights {g('engine_weight_bytes')}, exact-merge "
        f"residuals {g('engine_residual_bytes')} (int16) in "
        f"{'pinned host memory' if plan['engine_residual_on_host'] else 'the engine GPU'}, transfer buffer "
        f"{g('engine_transfer_bytes')}, vLLM overhead {g('engine_overhead_bytes')} (vLLM 0.34's sizing from the "
        f"widths) -> KV cache "
        f"{g('engine_kv_cache_bytes')}; host {g('engine_host_bytes')}",
        f"engine GPU with --sync delta: bf16 weights {g('engine_weight_bytes')}, no residual, transfer buffer "
        f"{g('engine_delta_transfer_bytes')} (one decoder layer, every element changed at worst) -> KV cache "
        f"{g('engine_delta_kv_cache_bytes')}, {'+' if gain >= 0 else '-'}{abs(gain) / gib:.2f} GiB against the "
        f"factor sync's; host 0.00 GiB{gone}; "
        f"per training GPU, not in the table's totals (those of --sync factors and full): a bf16 shadow "
        f"{g('trainer_delta_shadow_bytes')} kept, and a sync transient {g('trainer_delta_sync_transient_bytes')} "
        f"(LoRA {g('trainer_lora_delta_sync_transient_bytes')}) in place of the sync's",
    ]
    if preset in TABLE2:
        lora, logra = TABLE2[preset]
        lines.append(f"the paper's Table 2 ({preset}, rank 256, whole-run averages per GPU with activations): LoRA "
                     f"{lora:.2f} GiB, LoGRA {logra:.2f} GiB; estimated here before activations: LoRA "
                     f"{g('trainer_lora_bytes')}, LoGRA {g('trainer_logra_bytes')}")
    if layout:
        lines.append(f"layout: {layout}")
    return lines

"""
kl_control.py: predicted-KL step control, with mismatch subtraction.

What it is
----------
RowAdam proposes a direction `U` per target layer (d, r); the merged update is
`W -= alpha * U A`. An update that is small in parameter space can still move next-token
probabilities a lot, so before merging, LoGRA predicts the policy change and picks the step
multiplier `alpha` that spends a KL budget (a trust region in the spirit of TRPO).

Sources: the paper, arXiv:2610.06647, and the authors' code (the Molt library),
https://github.com/skzhang1/labs-molt/tree/logra/examples/scripts/logra.

Use
---
    import kl_control
    import ppo
    import sketch
    from rowadam import RowAdam

    temperature = 1.0                                  # the rollout's sampling temperature
    layers = sketch.attach(model, seed=0)              # S and A on every target nn.Linear; rank: sketch.default_rank
    opt = RowAdam(layers)                              # row moments; the layers' seed
    # One update. The loss's backward goes into the sketches S = G A^T; no weight gradient exists.
    logp = ppo.response_logprobs(model(input_ids=ids).logits, ids, temperature)  # (B, T)
    loss, _ = ppo.policy_loss(logp, advantages, mask, num_tokens=ppo.global_token_count(mask))
    loss.backward()
    try:
        opt.prepare()                                  # RowAdam's directions U (d, r): opt.directions
        probe = kl_control.probe(model, layers, opt.directions, ids, mask, temperature=temperature,
                                 keep_positions=256)   # KL1; the logits "before" at 256 positions, for kl_real
        budget = kl_control.budget_for(probe)          # nats per token: 0.2 of the entropy, <= 2 nats a response
        alpha = kl_control.solve_alpha(probe.kl1, budget=budget)  # min(3, sqrt(budget / KL1))
    except Exception:
        opt.discard()                                  # nothing merged: weights and RowAdam as they were
        raise
    factors = opt.merge(alpha)                         # W -= F A, F = bf16(alpha U): what engines receive
    kl_real = kl_control.realised_kl(probe, model, ids, mask)  # the merged step's exact KL per token

`model` is a causal LM with fp32 weights (RowAdam merges into them), `ids` (B, T) prompt and
response tokens, `mask` (B, T) True on the response's tokens only (never a row's first
position, which has no log-prob: refused), `advantages` (B,). The `Probe` that `probe` returns
records what it scored (which responses, the token limit, the temperature), the policy's
entropy and response length there, and the logits it kept (`keep_positions`; 0, the default,
keeps none: only `realised_kl` reads them), so `realised_kl` and `budget_for` repeat none of
it. The paper's schedule instead of the default budget:
`kl_control.kl_budget(opt.update, start=2e-4, end=2e-5, horizon=300)` (its 7B run; the
horizon is the run's length). With a separate rollout engine, also subtract the mismatch:
`mismatch.observe(rollout_logprobs, logp.detach(), mask, eos)` after the backward and `budget =
mismatch.adjust(budget)` (a `Mismatch`, kept and checkpointed with the optimizer). Every
trainer process makes the same calls (FSDP all-gathers inside). `LoGRAOptimizer` (at the end
of this file) is the same update as one `torch.optim` step: `opt.step(ids, mask)`, with
defaults that depend on where the model's weights start ("The one-call form's defaults"
below): for trained weights (a model loaded with `from_pretrained`) the calls above, bit for
bit; for random weights RowAdam's step scaled per layer, a larger cap and budget share, the
same as the calls above with `opt.prepare(per_layer=True)`, `budget_for(probe,
entropy_share=0.4)` and `solve_alpha(..., alpha_max=9.0)`. Its `calibrate=True` adds the
prediction's calibration ("Calibration" below): `cal = kl_control.Calibration()` kept beside
the optimizer, `alpha = kl_control.solve_alpha(cal.adjust(probe.kl1), ...)`, and after the
merge, when alpha is under its cap, `cal.observe(kl_real, alpha**2 * probe.kl1)`.

The math
--------
The paper's method section on predicted-KL step control predicts how far an update would
move the token probabilities before applying it, and picks alpha so that the predicted KL
fits a budget; the prediction grows as alpha^2, and the paper calls it "an estimate used for
control, not a guarantee" (`realised_kl` measures the KL a merge really caused).

For the direction at alpha = 1 every target weight moves by `dW = -U A` (d, k). Forward-mode
AD pushes these weight tangents through the model at once (weights untouched), so each
position gets its logits `z` and the logit tangent `u = dz/dalpha`. At a target layer
`Y = X W^T + b` the output's tangent is

    dY = dX W^T + X dW^T = dX W^T - (X A^T) U^T                  (N, d)

With temperature T,

    p   = softmax(z / T),   q = u / T
    kl1 = 0.5 * sum_v p_v (q_v - sum_w p_w q_w)^2                (half the variance of q under p)

which is the second-order term of KL(p || p(alpha)) = alpha^2 kl1 + O(alpha^3). KL1 is the
mean of kl1 over the generated tokens of the probed responses of every trainer process (the
paper's first 2 of each process's 16: an eighth, and more until they hold 128 scored tokens,
departure 3; sums and counts reduced across processes); then

    alpha  = min(alpha_max, sqrt(budget / KL1))        alpha_max = 3.0; KL1 = 0 gives 1.0
    budget = end + (start - end) * 0.5 (1 + cos(pi min(n / (H - 1), 1)))     the paper's: `kl_budget`
             start = 2e-4, end = 2e-5, H = 300 updates (its 7B run)

and, this file's default where the paper's values are not given (`budget_for`, "Defaults" below),

    budget = min(entropy_share * H_tok, per_response / L)   entropy_share = 0.2, per_response = 2 nats

with H_tok the policy's mean entropy per probed token and L the probed tokens per response.

`plain_probe` computes KL1 exactly as written here: dW, forward-mode AD through the model's
own forward, kl1 at every scored position. `probe` is the fast path (`fast_probe`): the
same numbers without the dense dW and without the whole (B, T, V) logits, the decoder and
its tangent written out for Qwen2, Qwen3, Llama and Mistral (`written_decoder`) and
forward-mode AD through the model's own decoder for the other families.

Mismatch subtraction (part of the LoGRA recipe in Table 1's setup: RowAdam with mismatch
subtraction and predicted-KL annealing): the rollout engine and the trainer disagree a little
on the log-probs of the same tokens (kernels, bf16). On the response tokens of samples that
ended with EOS (or of every sample: departure 4),

    observed = max(0, mean(rollout_logprob - trainer_logprob))   (a Monte-Carlo KL(engine || trainer))
    m        <- 0.7 m + 0.3 observed
    budget   <- max(budget - m, 0.5 budget)

so the update only gets what the existing mismatch leaves of the budget. `m` is optimizer
state and is checkpointed.

Calibration (`Calibration`, LoGRAOptimizer's `calibrate=True`; not the paper's, departure 5): the
prediction alpha^2 KL1 is second order, and where a step moves the logits by a nat or more
the realised KL falls below it. After each merge whose alpha the budget set (alpha <
alpha_max), the realised KL at the probe's kept positions is compared with the prediction,

    ratio  = clamp(realised / (alpha^2 KL1), 0.1, 10)
    log rho <- 0.7 log rho + 0.3 log ratio              rho = 1 before the first
    alpha  = min(alpha_max, sqrt(budget / (rho KL1)))   every later update

so that the budget is spent in realised KL, the quantity it is stated in. Its fixed point is a
realised KL equal to the budget; the realised KL grows with alpha, so the loop settles there
rather than running away, and the clamp bounds what one update can teach it. rho is
optimizer state and is checkpointed.

Shape legend: B batch, T time, V vocab, N tokens, d out rows, k in columns, r rank, h hidden
width, M scored positions, c positions of one output-head chunk.

Defaults, and how to choose them
--------------------------------
alpha_max = 3 and the 4096-token cut, the paper's (LoGRAOptimizer's cap for random weights
is 9: "The one-call form's defaults" below); `temperature` is the sampling one; the probe
scores the paper's share of each process's responses, an eighth, and at least 128 tokens
(departure 3). The budget, where none is given, is `budget_for`'s (LoGRAOptimizer's share
for random weights is 0.4):

    budget = min(0.2 * H_tok, 2 / L)        nats per token; H_tok entropy per token, L tokens per response

The paper's values are explicit in its runs (train.py's presets pass them):
`kl_budget(update, start=2e-4, end=2e-5, horizon=300)` with RowAdam's update_ratio 6e-5.

Why this rule, and why it holds from a 64-wide toy to 7B. A KL is measured on the policy's
output distributions, so nothing in it grows with the model's width (a learning rate does:
the same rate moves a wider model's outputs further, which is why AdamW's best rate is 3e-3
on examples/minimal_loop.py's toy and train.py's 7B preset takes 1e-6). What a budget fixed
in nats cannot know is how far the task needs the policy to move in an update, and two
properties of the batch carry that:
- The entropy per token. A policy near chance (a random toy: 2.5 nats a token) must move far
  and can; a policy sure of its tokens (train.py's tiny base policy: 0.07-0.17 nats, falling
  as it learns) has little to move per token without losing what it knows. AdamW at its best
  rate spends a few percent of the entropy per update while it learns (measured: 2-9% on the
  toy, 1-13% on the tiny base policy); LoGRA's 0.2 is a prediction, which the realised KL
  meets at about half on the toy (median 0.45, seeds 0 and 1), so its steps spend about 9%,
  where AdamW's do. As the policy grows sure, the budget shrinks with its entropy: no horizon
  is needed.
- The response's length. An outcome reward judges whole responses, so the step that matters
  is the KL of a whole response, and `per_response` caps it at 2 nats an update. On the
  random toy's 6-token responses the cap binds while it is near chance (0.2 x 2.5 nats > 2 / 6)
  and the entropy term once it grows sure; on the tiny base policy the entropy term binds
  throughout; at the paper's lengths the cap does: about 2e-3
  per token over ~1000-token responses, ten times the paper's 2e-4 (its 7B run; not measured
  here, and its preset keeps 2e-4).
The one-call form's defaults. `LoGRAOptimizer` takes its defaults from where the model's
weights start (`start`; STARTS). Trained weights (`start="pretrained"`, what `start="auto"`
takes for a transformers model loaded with `from_pretrained`) get the three calls above, bit
for bit: the paper's controller. Random weights (`start="scratch"`, a model built from a
config; a model with no transformers config too, with a warning) get four departures, each
chosen on bench/README.md's `defaults.py` family (nine small loops, eight from random weights
and train.py's tiny base policy, held-out greedy scores; `--tune`: the choosing seeds 0-4, the two check loops never looked
at) and reported on seeds 5-9 against AdamW at its best rate:
- RowAdam's step scaled per layer (`per_layer=True`, departure 6): each layer moves by
  update_ratio x alpha of its own ||W||. With the paper's one scale, a layer moves in
  proportion to its sketch's norm (on the tests' tiny Qwen2, one backward: 0.02% to 2.8% of
  the layer's ||W|| at a total of 1%).
- alpha_max = 9 (OPTIMIZER_ALPHA_MAX): a step of at most 9% of each layer's ||W||. Scaled per
  layer, the loops whose outputs barely depend on the weights (std 0.02 init: alpha at the cap
  in every update) need more than 3%; 27% broke them.
- entropy_share = 0.4 (OPTIMIZER_ENTROPY_SHARE), the budget's share of the entropy per token.
- The prediction calibrated ("Calibration", departure 5).
The search, from the earlier defaults (one scale, alpha_max 3, share 0.2, calibrated),
held-out means on seeds 0-4 (`defaults_tuning`): per layer alone raised the base loop from
0.575 to 0.615, batches of 16 from 0.560 to 0.606 and the std-0.02 loop from 0.769 to 0.838;
with a 9% cap and share 0.4 (update_ratio 0.03 with alpha_max 3, the same step) to 0.622,
0.709 and 0.937. Two settings that differ only in rounding (update_ratio 0.03 with alpha_max 3
against 0.01 with 9) differ by up to 0.08 in a loop's mean over 5 seeds, so differences under
that are not resolved here. On seeds 5-9 these settings come within 0.03 of AdamW's best on
seven of the nine loops (the base loop, 6-token answers, batches of 16, std 0.02, both check
loops, the toy), within 0.037 on the tiny base policy, and 0.19 short on 64-token answers,
where each run either learns the rule or does not (sd 0.38 AdamW, 0.28 LoGRA over the 5
seeds: the gap is under one standard error). The earlier defaults fell short by 0.08-0.24 on
six loops.
Why trained weights get the paper's controller instead. On SmolLM2-135M-Instruct, the one
pretrained model tried (bench/README.md, `defaults_smollm2`: 30 updates of 16 one-step sums,
held-out pass@1 from 0.170, seeds 0-2), the paper's controller reached 0.575, 0.790 and 0.770;
the settings for random weights 0.375, 0.865 and 0.205, and without calibration 0.695, 0.830
and 0.060 (seed 2 failed under both, and learnt under the paper's one scale). The failed runs
drifted to answers at the 64-token limit. A reading, not measured: scaled per layer, a layer
whose sketch is small (little of the reward's signal) still moves its full share of its
weights, which on random weights evens out what the init made uneven and on trained ones may
spend the budget on noise. The one small loop that starts trained, train.py's tiny base
policy, points the same way (per layer alone: 0.938 to 0.895 on seeds 0-4). Three runs a form do not settle it, and this rule was set
after seeing them (they are its reason, not its check); the paper's controller is also the one
measured, through train.py, within 0.021 of AdamW on SmolLM2's one-step arithmetic in words. `start="auto"`
reads how the model was made (`model_start`), not its weights: pass `start` for a random model
built with `from_config` from a loaded config, or for trained weights put in with
`load_state_dict` (as the family's tiny base policy is: it ran with the settings for random
weights). train.py keeps the paper's controller with its presets' budgets.

The budget and alpha. RowAdam (rowadam.py) scales U so that ||U A|| = update_ratio ||W||,
and KL1 is quadratic in U, so with K the KL1 of the same direction scaled to ||U A|| = ||W||

    KL1         = update_ratio^2 K
    alpha       = min(alpha_max, sqrt(budget / KL1))
    alpha^2 KL1 = min(alpha_max^2 KL1, budget)          the step's predicted KL

- While alpha is capped (alpha = alpha_max: alpha_max^2 KL1 < budget), the budget does not
  bind: the step is alpha_max U, set by update_ratio, and spends less KL than budgeted.
- Once the budget binds (alpha < alpha_max), update_ratio stops mattering: the merged step
  alpha U = sqrt(budget / KL1) U is the same for any update_ratio, and its predicted KL is
  the budget. It binds once update_ratio is at least its present value times
  sqrt(budget / (alpha_max^2 KL1)).
(tests/test_kl_control.py::test_update_ratio_sets_the_step_only_while_alpha_is_capped.)

What to watch: alpha, every update. alpha = alpha_max for updates in a row means the budget
does not bind (every step is update_ratio's, unbudgeted; `LoGRAOptimizer` warns after
CAPPED_UPDATES). It is not by itself a reason to raise update_ratio: a policy whose outputs
barely depend on its weights (a random model at transformers' std 0.02) spends little of
any budget at the cap, yet on such a loop (bench/README.md, `defaults.py`, "init 0.02":
a one-token answer, alpha capped in 400 of 400 updates) raising the cap 3x (alpha_max 27,
the same as update_ratio 0.03) took LoGRAOptimizer's held-out score from 0.938 to 0.075
(seeds 0-4), and lowering it to 3 to 0.838; with the three calls (one scale, cap 3% of ||W||)
update_ratio 0.03 and 0.1 took it from 0.769 to 0.614 and 0.167, and 0.003 and 0.001 to 0.679
and 0.434. So the warning says to change update_ratio only on a held-out metric. And the realised KL (`realised_kl`) against the
prediction alpha^2 KL1, which is second order: a realised KL far from it means a step beyond
that regime. LoGRAOptimizer's calibration learns the ratio (`last["kl_scale"]`, rho) and
spends the budget in realised KL; a rho that sits at its clamp (0.1 or 10) means the
prediction no longer tracks the step, so lower the budget.

Departures from the paper
-------------------------
1. The tangent -(X A^T) U^T that `probe` injects at a target layer is formed in the
   activations' dtype (bf16 on GPUs), as the rest of the forward is. The paper does not say
   in what precision; the authors' newest probe forms it in fp32 and casts it back. Tried on
   the tiny Qwen2 against float64, fp32 did not lower KL1's error, which the bf16 forward's
   own rounding dominates (the matmuls accumulate in fp32 already), while an fp32 (N, d)
   tangent would double the probe's largest transient per layer. Test:
   tests/test_kl_control.py::test_kl1_in_bf16_against_float64 (within 0.5% of float64, bf16
   weights and bf16 autocast).
2. `solve_alpha` with KL1 = 0 (a direction that moves no scored logit) returns
   min(1.0, alpha_max). The paper's alpha = min(alpha_max, sqrt(budget / KL1)) divides by
   zero there; the authors' code returns 1.0, even when `alpha_max` < 1. `alpha_max` is the
   user's bound on every step, and here it holds without exception. Test:
   tests/test_kl_control.py::test_solve_alpha.
3. The probe scores, by default, the first eighth of each process's responses, at least 2
   (`PROBE_SHARE`, `PROBE_RESPONSES`): the paper probes the first 2 of each process's 16 (128
   prompts over 8 GPUs), and this keeps that share at any batch, so that the probe's cost
   stays a fixed part of the update's (a floor in tokens would make it score every response
   of a small batch of short responses). `max_responses=n` scores exactly the first n;
   `min_tokens=m` adds responses until they hold m scored tokens (train.py's presets:
   `probe_count`). Test: tests/test_kl_control.py::test_the_default_probe_scores_the_papers_share_of_the_batch.
   With several responses per prompt (GRPO-style groups in contiguous rows), the first rows
   are one prompt's: pass the rows reordered so that each group's first response comes first
   (for groups of G, `order = torch.arange(B).view(-1, G).t().reshape(-1)`, as train.py
   does), and the same rows to `realised_kl`.
4. `Mismatch.observe(..., ended_with_eos=None)` counts every response. The paper's rule
   counts only responses that ended with EOS (pass their flags for it); fixed-length
   responses never do, and under that rule the mismatch would never be observed nor
   subtracted. Test: tests/test_kl_control.py::test_mismatch_without_eos_flags.
5. `LoGRAOptimizer` calibrates the prediction for random weights (`start="scratch"`;
   "Calibration" above): its alpha is sqrt(budget / (rho KL1)), with rho learnt from the
   realised KL of earlier updates; the paper's alpha is sqrt(budget / KL1) (`calibrate=False`,
   `start="pretrained"`, and the three calls of the Use block). Reason: on the small loops of
   bench/README.md a budget-bound step realised about half of its predicted KL (`defaults_why`:
   8.8% and 10.3% of the entropy per update on the base loop and at batches of 16 with the three
   calls, where the budget is 20%). With RowAdam's one scale, calibration raised the held-out
   scores on seeds 0-4 where the budget binds (the base loop 0.427 to 0.575, batches of 16 0.449
   to 0.560, the tiny base policy 0.908 to 0.938); with the other settings for random weights
   (per layer, alpha_max 9, share 0.4) seeds 0-4 did not tell (`defaults_tuning`,
   "uncalibrated": the base loop 0.587 to 0.620, batches of 16 0.605 to 0.676, but 6-token
   answers 0.373 to 0.322 and the tiny base policy 0.891 to 0.854). Without calibration on
   seeds 5-9 (run when it was briefly dropped, so for this one knob seeds 5-9 were seen before
   it was kept): the base loop 0.578 against 0.684 with it, batches of 16 0.630 against 0.687,
   the check loops 0.563 and 0.587 against 0.704 and 0.755, the tiny base policy 0.892 against
   0.932; 64-token answers 0.760 against 0.572 and 6-token answers 0.345 against 0.324 the
   other way. On SmolLM2-135M-Instruct it did not help (above). It costs the realised KL's
   forward over the probed responses and 256 kept positions of logits (256 V values: 78 MB
   at a vocabulary of 152k in bf16). train.py does not calibrate: its presets are the
   paper's recipe, and its measured runs (bench/README.md, real_model) were made without.
   Tests: tests/test_kl_control.py::test_the_calibration_rule,
   test_the_calibrated_optimizer_is_its_formula_bitwise_and_resumes,
   test_calibration_spends_the_budget_in_realised_kl.
6. `LoGRAOptimizer` scales RowAdam's step per layer for random weights (`start="scratch"`:
   `per_layer=True`, rowadam.py's departure 3): each layer's U is scaled to ||U_l A_l|| =
   update_ratio ||W_l||, where the paper has one scale c for all layers, which moves each
   layer in proportion to its sketch's norm. Reason (bench/README.md, `defaults_why`, seeds 0-4 at fixed step sizes with no KL
   control): with one scale, the sketched step reached 0.670, 0.614 and 0.759 on the base
   loop, batches of 16 and the std-0.02 loop, against AdamW's best 0.619, 0.749 and 0.962;
   scaled per layer, 0.704, 0.728 and 0.960. The sketch was not what fell short: the same
   step without it (A = I) reached 0.666, 0.700 and 0.762 with one scale. With it come the
   one-call form's own alpha_max (9) and entropy_share (0.4), chosen with it ("The one-call
   form's defaults"). On trained weights it did worse (SmolLM2, same section), and there
   `start="auto"` keeps the paper's one scale, as the three calls and train.py do. Tests:
   tests/test_rowadam.py::test_per_layer_scale_gives_each_layer_its_share_of_its_weights,
   tests/test_kl_control.py::test_the_one_call_optimizer_is_the_three_calls_bitwise,
   tests/test_kl_control.py::test_start_reads_how_the_model_was_made.

Implementation notes
--------------------
- The fast path runs the decoder once and applies the output head to the scored positions
  only, in chunks of `HEAD_CHUNK_BYTES` (256 MiB) of work, so the (B, T, V) logits and their
  tangent are never held at once, whatever the vocabulary.
- The fast path forms the tangent of every target layer and of the output head itself,
  dY = dX W^T (- (X A^T) U^T at the targets): PyTorch's own tangent of a linear layer whose
  weight has none also multiplies X by a zero weight tangent, one matmul more per layer, the
  head's (M, h) x (h, V) included. The same numbers (X 0 = 0 exactly).
- Elementwise + - * / with one dual and one constant operand (a norm's weight, RoPE's cos,
  a scalar) get their tangents formed directly (`_ConstantOperands`): PyTorch's zero-tensor
  path runs Python meta kernels, ~0.1 ms an op on a CPU. Bit for bit PyTorch's numbers
  (tests/test_kl_control.py::test_constant_operand_tangents_are_pytorch_own). With the two
  notes above, and the realised KL's "before" taken from the probe's own forward instead of
  one more forward, the probe phase of train.py's tiny preset (a 2-layer Qwen2 of width 64)
  went from 24-25 ms to 14 ms (median over 40 updates on a 2-core CPU).
  tests/test_kl_control.py::test_the_fast_path_is_the_plain_probe checks the fast path
  against `plain_probe`.
- For Qwen2, Qwen3, Llama and Mistral the fast path runs neither forward AD nor the function
  mode: `written_decoder` forms the decoder's primal as transformers' modules do with SDPA
  attention, their default (so the kept logits are the model's own, and `scored_logits` runs
  the same primal), and the tangent of each op from its derivative (the comment above it
  lists them), about half the tensor operations of the forward-AD path. Measured on examples/minimal_loop.py's toy (22
  responses probed, one thread): 10.2 ms a probe with forward AD, 5.4 ms written out, against
  2.3 ms for the realised KL (a plain forward of the same responses and its exact KL; bench/README.md,
  `loop_phases`, all in one run). At a wider model the tangent's second set of matmuls
  dominates and the two paths cost about the same (`kl_probe`). On the toy under
  `torch.compile` the written-out probe takes 3.7 ms, but its first update spends 32 s compiling (and static
  shapes compile again at each new sequence length), so it stays eager here. Its
  primal attention is torch's fused kernel (SDPA, the model's default; the realised KL's
  forward is that and nothing more), and the tangent forms P and dS once each: at its peak 10
  bytes a score entry in bf16, where forward AD through the eager attention holds 24
  (infra/memory_plan.py, assumption 4). A model it does not cover (another family, a hook or
  a forward of its own on a module it would bypass, a sliding window shorter than the
  sequence) takes the forward-AD path; both are checked against `plain_probe`.
- The realised KL's "before" is the probe's own logits at its first `keep_positions` scored
  positions (all of them when there are fewer: `Probe.kept` says how many); `scored_logits`
  gives the same bits for the same weights
  (tests/test_kl_control.py::test_the_kept_logits_are_the_realised_kls_before).
- `max_tokens` (default 4096) cuts each probed sequence, prompt included, to its first
  `max_tokens` tokens: the paper's "at most 4096 tokens" read as the sequence the probe's
  forward holds. At the paper's context of 4096 tokens (prompt and response) it cuts nothing.
- The probe refuses, before its forward, what it cannot use: no directions yet (None:
  `RowAdam.prepare()` makes them), directions that are not one (n, r) per layer, a bad
  temperature or count. On any error it leaves no hook, no forward-AD level and no torch
  function mode behind, and the model in its mode (tests/test_kl_control.py::test_probe_errors).
- The cosine schedule is written as the weighted mean `w start + (1 - w) end`, which gives
  exactly `start` at update 0 and exactly `end` from update H - 1 on
  (tests/test_kl_control.py::test_kl_budget_schedule).
"""

import contextlib
import math
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist

# Bytes of output-head work per probe chunk: a scored position holds about 56 V bytes at once
# (the head's logits and tangent, and token_kl's float64 softmax and products), so at a
# vocabulary of 152k a chunk is 31 positions. Sized in bytes, not positions, so that no
# vocabulary makes a chunk too large (implementation notes: the head in chunks).
HEAD_CHUNK_BYTES = 256 * 2**20
BYTES_PER_VOCAB_ENTRY = 56
# Positions per block of the realised KL's float64 work (two log-softmaxes, a product: about
# 32 V bytes a position, 311 MiB at a vocabulary of 152k).
KL_CHUNK_POSITIONS = 64
# What the probe scores by default: the paper's share of each process's responses, 2 of its 16
# (128 prompts over 8 GPUs), so one in PROBE_SHARE and at least PROBE_RESPONSES, and more
# until they hold PROBE_FLOOR scored tokens (departure 3); each sequence cut to the paper's
# 4096 tokens. PROBE_TOKENS: the larger floor train.py's presets ask for (`probe_count`).
PROBE_RESPONSES = 2
PROBE_SHARE = 8
PROBE_FLOOR = 128
PROBE_TOKENS = 512
MAX_TOKENS = 4096
# The default budget (`budget_for`): a share of the policy's entropy per token, and at most so
# many nats per response (the module docstring's "Defaults").
ENTROPY_SHARE = 0.2
PER_RESPONSE = 2.0
# LoGRAOptimizer's defaults for a model that starts from random weights, where they differ from
# the three calls' (the module docstring's "The one-call form's defaults"): RowAdam's scale per
# layer, a larger cap and budget share, the prediction calibrated. A model loaded with trained
# weights takes the three calls' (the paper's controller). STARTS: each start's settings.
OPTIMIZER_ALPHA_MAX = 9.0
OPTIMIZER_ENTROPY_SHARE = 0.4
STARTS = {"pretrained": {"per_layer": False, "alpha_max": 3.0, "entropy_share": ENTROPY_SHARE, "calibrate": False},
          "scratch": {"per_layer": True, "alpha_max": OPTIMIZER_ALPHA_MAX, "entropy_share": OPTIMIZER_ENTROPY_SHARE,
                      "calibrate": True}}
# Scored positions whose logits LoGRAOptimizer keeps for the realised KL when it calibrates (`Calibration`).
CALIBRATION_POSITIONS = 256
# Updates in a row with alpha at its cap before LoGRAOptimizer (and train.py) warn.
CAPPED_UPDATES = 5


# -----------------------------------------------------------------------------
# The second-order KL of one position

def token_kl(logits, tangent, temperature=1.0):
    """kl1 = 0.5 Var_p(tangent / T), p = softmax(logits / T), per position (...,), in float64."""
    if logits.shape != tangent.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tangent {tuple(tangent.shape)} differ in shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    z = logits.to(torch.float64) / temperature  # (..., V)
    q = tangent.to(torch.float64) / temperature  # (..., V)
    p = torch.softmax(z, dim=-1)  # (..., V)
    # kl1 = 0.5 sum_v p_v (q_v - E_p[q])^2
    mean_q = (p * q).sum(-1, keepdim=True)  # (..., 1)
    return 0.5 * (p * (q - mean_q).square()).sum(-1)  # (...,)


def token_entropy(logits, temperature=1.0):
    """H(p) = -sum_v p_v log p_v, p = softmax(logits / T), per position (...,), in float64."""
    log_p = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1)  # (..., V)
    return -(log_p.exp() * log_p).sum(-1)  # (...,)


# -----------------------------------------------------------------------------
# The probe as its math reads: dW = -U A pushed through the model by forward-mode AD

@contextmanager
def probe_mode(model):
    """Eval mode and eager attention (SDPA's fused kernels have no forward AD); restored on exit.
    The realised KL's forwards run in it too, so that they see the probe's own logits."""
    training = [m for m in model.modules() if m.training]  # each module's own mode comes back
    attn = model.config._attn_implementation
    for m in training:  # model.eval(), without its walk of every module when none trains
        m.training = False
    if attn != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if attn != "eager":
            model.set_attn_implementation(attn)
        for m in training:
            m.training = True


def _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask):
    """The probed part of the batch: (ids (B', T'), scored positions (B', T' - 1), attention mask
    (B', T') or None). Every sequence is cut to its first `max_tokens` tokens, and position t is
    scored when token t + 1 was generated. B' = `max_responses` (all when fewer), or with None
    the first PROBE_RESPONSES and more until they hold `min_tokens` scored positions (departure 3)."""
    if input_ids.dim() != 2 or input_ids.shape != response_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ in shape, or are not (B, T)")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} and input_ids "
                         f"{tuple(input_ids.shape)} differ in shape")
    if not max_tokens >= 2:
        raise ValueError(f"max_tokens must be >= 2 (a token and the generated one it scores), got {max_tokens}")
    if max_responses is not None and not max_responses >= 1:
        raise ValueError(f"max_responses must be >= 1, or None for the default rule, got {max_responses}")
    if not min_tokens >= 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    scored = response_mask[:, :max_tokens].bool()[:, 1:]  # (B, T' - 1)
    if max_responses is None:  # the paper's share of the batch (departure 3), and the token floor if asked
        share = min(len(scored), max(PROBE_RESPONSES, -(-len(scored) // PROBE_SHARE)))
        n = probe_count(scored, share, min_tokens) if min_tokens else share
    else:
        n = max_responses
    am = None if attention_mask is None else attention_mask[:n, :max_tokens]
    return input_ids[:n, :max_tokens], scored[:n], am


def _check_probe_inputs(layers, directions, temperature, keep_positions):
    """Refuse, before any forward or hook, what the probe cannot use (implementation notes)."""
    if directions is None:
        raise ValueError("directions is None: the probe needs RowAdam's directions U; call opt.prepare() "
                         "first (after the loss's backward) and pass opt.directions")
    if len(directions) != len(layers):
        raise ValueError(f"{len(layers)} layers but {len(directions)} directions: pass the directions that "
                         f"prepare() made for these layers (opt.directions of the RowAdam over them)")
    for layer, u in zip(layers, directions):
        # U has the sketch's shape: (d, r), or this process's (n, r) rows of a row-sharded layer
        if not isinstance(u, torch.Tensor) or u.shape != layer.sketch.shape:
            got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(f"{layer.name}: direction {got}, but the layer's U is {tuple(layer.sketch.shape)} "
                             f"(its sketch's shape): pass opt.directions, in the order of `layers`")
    _check_temperature(temperature)
    if not keep_positions >= 0:
        raise ValueError(f"keep_positions must be >= 0, got {keep_positions}")


def _check_first_position(rows):
    """Refuse a response mask that covers the first position of `rows` rows: the token there
    has no logits before it, so no log-prob, and a loss or probe would silently drop it."""
    if rows:
        raise ValueError(f"response_mask covers the first position of {rows} row(s): a row's first token has no "
                         f"log-prob (nothing precedes it), so it cannot be a generated token; the mask is True on "
                         f"the response's tokens only, after at least one prompt token")


NO_TOKEN = "no generated token to score: response_mask has no position after the first"


def left_padded_rows(input_ids, pad_token_id) -> torch.Tensor:
    """How many rows of `input_ids` (B, T) begin with more `pad_token_id` tokens than another row
    does: prompts padded on the left, as `model.generate` pads them (a 0-dim count; 0 without a
    pad id). Every row beginning with the same number (none, or one pad that is also BOS) is an
    aligned batch."""
    if pad_token_id is None or input_ids.numel() == 0:
        return torch.zeros((), dtype=torch.long)
    lead = (input_ids == pad_token_id).long().cumprod(1).sum(1)  # (B,) leading pad tokens
    return (lead > lead.min()).sum()


def check_batch(input_ids, response_mask, *, attention_mask=None, max_responses=None, min_tokens=PROBE_FLOOR,
                max_tokens=MAX_TOKENS, group=None, pad_token_id=None) -> None:
    """Refuse a batch that `probe` with these arguments would refuse, with the probe's message,
    before anything is computed: ids and masks of different shapes, a response mask on a row's
    first position, no generated token among the responses it would score; and, given the
    model's `pad_token_id`, a batch padded on the left without its `attention_mask` (the probe
    would attend to the padding: `left_padded_rows`). The counts are reduced over the processes
    as the probe reduces them, so every process refuses or none. `LoGRAOptimizer.step` calls it
    before RowAdam's prepare, so a refused batch changes nothing, its sketches included."""
    _, scored, _ = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    left = left_padded_rows(input_ids, pad_token_id if attention_mask is None else None)
    counts = torch.stack([response_mask[:, 0].bool().sum(), scored.sum(), left]).to(torch.float64)  # (3,)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    first, count, left = counts.tolist()
    _check_first_position(int(first))
    if count == 0:
        raise ValueError(NO_TOKEN)
    if left:
        raise ValueError(f"{int(left)} row(s) begin with more pad tokens (id {pad_token_id}) than others: the batch "
                         f"was padded on the left, as model.generate pads prompts, and no attention_mask was given; "
                         f"pass generate's, step(ids, mask, attention_mask), so that no token attends to padding")


def _check_temperature(temperature):
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (the sampling temperature), got {temperature}")


@dataclass(frozen=True)
class Probe:
    """What one probe gives: KL1 (reduced over processes), what it scored, and the logits it
    kept for `realised_kl`, which reads all of it from here and so cannot disagree with it."""
    kl1: float
    logits: torch.Tensor | None  # (kept, V): this process's, at its first scored positions; None: keep_positions=0
    kept: int  # rows of `logits`: min(keep_positions, this process's scored positions)
    responses: int  # this process's first `responses` responses were scored,
    max_tokens: int  # each cut to its first `max_tokens` tokens,
    temperature: float  # at this temperature;
    entropy: float = math.nan  # the policy's mean entropy per scored token (nats), reduced over processes;
    tokens_per_response: float = math.nan  # scored tokens per probed response, over all processes


@torch.no_grad()
def probe_logits(model, layers, directions, input_ids, attention_mask=None):
    """(logits z, logit tangent u = dz/dalpha) (B, T, V) of the model's own forward, with the
    tangent dW = -U A on every target layer's weight, by `torch.func.jvp`. One process, whole
    directions (d, r); dense (d, k) tangents: for reading and for tests (the JVP is checked
    against finite differences)."""
    _check_probe_inputs(layers, directions, 1.0, 0)
    if any(layer.group is not None for layer in layers):
        raise ValueError("the plain probe runs on one process with whole directions; "
                         "layers attached with a group need probe(...)")
    names = {module: name for name, module in model.named_modules()}
    weights, tangents = {}, {}
    for layer, u in zip(layers, directions):
        w = layer.module.weight  # (d, k)
        weights[names[layer.module] + ".weight"] = w
        # dW = -U A. Shapes: (d, r) @ (r, k) -> (d, k)
        tangents[names[layer.module] + ".weight"] = -(u.to(w.dtype) @ layer.projection.to(w.dtype))

    def logits(target_weights):  # the model's logits (B, T, V) with these target weights
        return torch.func.functional_call(model, target_weights, kwargs=dict(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False)).logits

    with probe_mode(model):
        _quiet_jvp_import()  # torch.func.jvp's first use, without torch.jit's warnings
        return torch.func.jvp(logits, (weights,), (tangents,))  # (B, T, V) each


@torch.no_grad()
def plain_probe(model, layers, directions, input_ids, response_mask, *, temperature=1.0, max_responses=None,
                min_tokens=PROBE_FLOOR, max_tokens=MAX_TOKENS, attention_mask=None, keep_positions=0) -> Probe:
    """`probe` as the module docstring's math reads, on one process: the logits and their
    tangent at every position (`probe_logits`), then KL1 = the mean of kl1 over the scored
    positions. `probe`'s arguments (but `group`) and result, to rounding; it holds a dense
    (d, k) tangent per target layer and the (B, T, V) logits with their tangent, which the fast
    path avoids."""
    _check_probe_inputs(layers, directions, temperature, keep_positions)
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    _check_first_position(int(response_mask[:, 0].bool().sum()))
    z, u = probe_logits(model, layers, directions, ids, am)  # (B', T', V) each
    # (M, V) each: the positions that sampled a generated token
    z, u = z[:, :-1][scored], u[:, :-1][scored]
    if z.shape[0] == 0:
        raise ValueError(NO_TOKEN)
    # KL1 = mean over the scored positions of kl1 = 0.5 Var_p(u / T)
    kl1 = token_kl(z, u, temperature).mean().item()
    entropy = token_entropy(z, temperature).mean().item()
    kept = z[:keep_positions] if keep_positions > 0 else None  # (kept, V)
    return Probe(kl1, kept, 0 if kept is None else kept.shape[0], ids.shape[0], max_tokens, float(temperature),
                 entropy, z.shape[0] / ids.shape[0])


# -----------------------------------------------------------------------------
# The fast path: `probe`, the same KL1 as `plain_probe` at a fraction of its work
#
# It exists because the plain probe does not fit a 7B run: it holds a dense (d, k) tangent for
# every target layer (a second copy of the targets' weights) and the (B, T, V) logits with
# their tangent (4.6 GiB in bf16 at a vocabulary of 152k and 2 x 4096 tokens, before token_kl's
# float64 work on them), and it pushes PyTorch's zero tangents of the norms, RoPE and the mask
# through Python meta kernels. The fast path is the same forward-mode AD without any of these:
# hooks form the target layers' and the head's tangents dY = dX W^T - (X A^T) U^T (no dW),
# `_ConstantOperands` forms constant-operand tangents directly (bit for bit PyTorch's), the
# decoder runs once and the head only on the scored positions, in chunks. Its KL1 and kept
# logits are `plain_probe`'s up to the rounding of (X A^T) U^T against X (U A)^T and of the
# head's matmul on fewer rows (tests/test_kl_control.py::test_the_fast_path_is_the_plain_probe),
# and it runs under FSDP2.

@contextmanager
def injected_tangents(layers, directions):
    """Each target layer's output gets the tangent of Y = X (W - alpha U A)^T + b at alpha = 0,

        dY = dX W^T - (X A^T) U^T

    formed here, without PyTorch's X dW^T with a zero dW: a pre-hook hands the layer its primal
    input only, so that its forward is the plain one, and keeps the incoming tangent dX; the hook
    forms dY. `directions` are whole (d, r) or, for layers attached with a group, this process's
    rows of U."""

    def hooks_for(layer, u):
        incoming = []  # dX, from the pre-hook to the hook of the same call

        def strip(module, args):
            x, dx = fwAD.unpack_dual(args[0])
            incoming.append(dx)
            return (x, *args[1:])

        def inject(module, args, y):
            dx, x = incoming.pop(), args[0]  # (..., k) each; dx is None before the first target
            # -(X A^T) U^T, in the activations' dtype (departure 1).
            # Shapes: (N, k) @ (k, r) -> (N, r); (N, r) @ (r, d) -> (N, d)
            p = x.reshape(-1, x.shape[-1]) @ layer.projection.to(x.dtype).t()
            # Row-sharded U (rowadam.py departure 1): this layer's whole U, gathered for this
            # forward only, as FSDP gathers the weight.
            u_all = layer.all_rows(u)  # (d, r)
            dy = (p @ -u_all.to(x.dtype).t()).reshape(y.shape)  # the sign on U: no (N, d) negation
            if dx is not None:
                dy = F.linear(dx, module.weight).add_(dy)  # dX W^T (the bias has no tangent), + dy
            return fwAD.make_dual(y, dy)

        return strip, inject

    _check_probe_inputs(layers, directions, 1.0, 0)
    handles = []
    try:
        for layer, u in zip(layers, directions):
            strip, inject = hooks_for(layer, u)
            handles += [layer.module.register_forward_pre_hook(strip), layer.module.register_forward_hook(inject)]
        yield
    finally:
        for h in handles:
            h.remove()


class _ConstantOperands(TorchFunctionMode):
    """Tangents of `dual op constant` for + - * / formed directly.

    Where one operand of an elementwise op carries a tangent and the other does not (a norm's
    weight, RoPE's cos and sin, the attention mask, a Python scalar), PyTorch's forward AD gives
    the constant a zero tangent, and arithmetic with zero tensors runs through Python meta
    kernels: about 0.1 ms an op on a CPU, a third of the tiny preset's probe. Those ops' tangents
    are linear in the dual operand's and formed here instead; every other call, and every call
    with two dual operands or none, is PyTorch's own. The same numbers bit for bit: x + 0 = x and
    the products are the same products.
    """

    FAST = {torch.Tensor.mul, torch.mul, torch.Tensor.add, torch.add, torch.Tensor.sub, torch.sub,
            torch.Tensor.div, torch.div}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs or len(args) != 2 or func not in self.FAST:
            return func(*args, **(kwargs or {}))
        (a, da), (b, db) = (_split(x) for x in args)
        if (da is None) == (db is None) or (db is not None and func in (torch.Tensor.div, torch.div)):
            return func(*args)  # two dual operands, none, or constant / dual: PyTorch's own rule
        out = func(a, b)
        if func in (torch.Tensor.mul, torch.mul):
            tangent = da * b if db is None else a * db
        elif func in (torch.Tensor.div, torch.div):
            tangent = da / b
        else:  # + and -: the dual operand's tangent, broadcast to the result
            tangent = da if db is None else (db if func in (torch.Tensor.add, torch.add) else -db)
            tangent = tangent.to(out.dtype).expand(out.shape)
        return fwAD.make_dual(out, tangent)


def _quiet_jvp_import():
    """Import torch's JVP decompositions, which `fwAD.dual_level()` and `torch.func.jvp` import on
    their first use in a process, with their warnings silenced: they script themselves with
    torch.jit, which warns under `warnings.simplefilter("always")` that torch.jit.script is
    deprecated, torch's own business and not the caller's. Nothing else is filtered."""
    if "torch._decomp.decompositions_for_jvp" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.* is deprecated", category=DeprecationWarning)
        try:
            import torch._decomp.decompositions_for_jvp  # noqa: F401
        except ImportError:  # a torch without it: the probe's forward AD imports nothing either
            pass


def _dual_level():
    """`fwAD.dual_level()`, without torch.jit's warnings (`_quiet_jvp_import`)."""
    _quiet_jvp_import()
    return fwAD.dual_level()


def _split(x):
    """(primal, tangent or None) of a tensor; (x, None) of anything else."""
    return tuple(fwAD.unpack_dual(x)) if isinstance(x, torch.Tensor) else (x, None)


@contextmanager
def _root_gathered(model):
    """Under FSDP2 the root module owns the embedding, final norm and output head; calling the
    decoder and head directly bypasses its hooks, so its parameters are gathered explicitly."""
    fsdp_root = hasattr(model, "unshard") and hasattr(model, "reshard")
    if fsdp_root:
        model.unshard()
    try:
        yield
    finally:
        if fsdp_root:
            model.reshard()


def _head_chunks(model, hidden, tangent=None):
    """The output head on the scored rows (M, h), a chunk of positions at a time: yields (logits,
    logit tangent or None), (c, V) each. The head's tangent is dH W_head^T, formed here as the
    target layers' are. Gemma 2's cap tanh(z / cap) cap, which its forward applies after the
    head, is applied here too, with its derivative 1 - tanh^2(z / cap). No rows give one empty
    chunk (0, V): a process without a scored position still has its (0, V) logits."""
    head = model.get_output_embeddings()
    chunk = max(1, HEAD_CHUNK_BYTES // (BYTES_PER_VOCAB_ENTRY * head.weight.shape[0]))  # positions
    cap = getattr(model.config, "final_logit_softcapping", None)
    for start in range(0, max(hidden.shape[0], 1), chunk):
        z = head(hidden[start:start + chunk])  # (c, V)
        u = None if tangent is None else F.linear(tangent[start:start + chunk], head.weight)  # (c, V)
        if cap:
            t = torch.tanh(z / cap)
            z = t * cap
            u = None if u is None else u * (1 - t * t)
        yield z, u


# -----------------------------------------------------------------------------
# The decoder and its tangent written out (Llama-like decoders): no forward AD, no per-op Python mode
#
# For the decoders of the families below (RMSNorm, rotary attention, a SwiGLU MLP: Qwen2, Qwen3,
# Llama, Mistral) `written_decoder` runs the forward as Hugging Face's modules do, op for op, its
# attention torch's fused kernel (SDPA, the models' default), and beside it the tangent of each
# op from its derivative:
#
#   linear (a target)     dY = dX W^T - (X A^T) U^T           (injected_tangents' rule)
#   linear (not a target) dY = dX W^T
#   RMSNorm               y = w (x r),  r = 1/sqrt(mean(x^2) + eps)  ->  dy = w r (dx - x r^2 mean(x dx))
#   rotary embedding      linear in q and k: dq' = dq cos + rot(dq) sin
#   attention             S = q k^T s + mask, P = softmax(S), O = P v (fused: no (B, H, T, T) tensor)
#                         dS = (dq k^T + q dk^T) s,  dP = P (dS - sum_j P dS),  dO = dP v + P dv
#                         (P and dS formed once each; P dv fused too)
#   SiLU                  dy = dx sig(x) (1 + x (1 - sig(x)))
#   product, residual     d(a b) = da b + a db,  d(a + b) = da + db
#
# about half the tensor operations of the forward-AD path and none of its per-op Python (the
# function mode and dual tensors): the fixed cost per probe that measurement found (bench/README's
# `loop_phases`). Other families (Gemma 2's capped, sandwiched layers, Phi-3's fused ones) and a
# sliding window shorter than the sequence take the forward-AD path; both paths are checked
# against plain_probe (tests/test_kl_control.py).

WRITTEN_OUT = ("qwen2", "qwen3", "llama", "mistral")


def _written_out(model, length: int) -> bool:
    """Whether `written_decoder` covers this model at this sequence length: a family it writes
    out, plain nn.Linear projections, no sliding window shorter than the sequence, and no
    forward hook on a module it would bypass (a hook that changes an output would be lost)."""
    config = model.config
    if getattr(config, "model_type", None) not in WRITTEN_OUT or getattr(config, "hidden_act", "silu") != "silu":
        return False
    for block in model.get_decoder().layers:
        attn, mlp = block.self_attn, block.mlp
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(m) is torch.nn.Linear for m in linears):
            return False
        window = getattr(attn, "sliding_window", None)
        if window is not None and window < length:
            return False
        norms = [block.input_layernorm, block.post_attention_layernorm] + \
            [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if not _bypassable([attn, mlp] + norms, linears):
            return False
    return _bypassable([model.get_decoder().norm], [])  # the embedding and rotary modules are called as modules


def _bypassable(modules, linears) -> bool:
    """No forward hook and no forward of their own on `modules`; on `linears` none either, but
    a sketch's (sketch.py's LayerSketch.forward, a plain F.linear under torch.no_grad)."""
    for m in modules + linears:
        if m._forward_hooks or m._forward_pre_hooks:
            return False
        own = vars(m).get("forward")
        if own is not None and not (m in linears and getattr(getattr(own, "__self__", None), "module", None) is m):
            return False
    return True


def _rms_norm(norm, x, dx):
    """Hugging Face's RMSNorm (in fp32, cast back, times the weight) and its tangent."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)  # (..., 1)
    xr = x32 * r
    y = norm.weight * xr.to(dtype)
    if dx is None:
        return y, None
    # dy = w r (dx - x r^2 mean(x dx)) = w r (dx - xr mean(xr dx))
    dx32 = dx.to(torch.float32)
    centred = torch.addcmul(dx32, xr, (xr * dx32).mean(-1, keepdim=True), value=-1)  # dx - xr mean(xr dx)
    return y, norm.weight * (r * centred).to(dtype)


def _rotary(x, dx, cos, sin):
    """x cos + rot(x) sin (Hugging Face's rotate_half: (x1, x2) -> (-x2, x1)), and the same of dx."""
    def rotate(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return (x * cos) + (rotate(x) * sin), None if dx is None else (dx * cos) + (rotate(dx) * sin)


def _plus(a, b):
    """a + b of two tangents, either of which may be None (zero)."""
    return b if a is None else a if b is None else a + b


def written_decoder(model, input_ids, attention_mask=None, tangents=None):
    """The decoder's last hidden state (B, T, h) and, with `tangents` ({target module: (layer,
    this process's U)}), its tangent for the direction dW = -U A of every target; None without.
    The module notes above. Runs under FSDP2 (each decoder layer gathered for its turn)."""
    decoder = model.get_decoder()

    def linear(module, x, dx):
        y = F.linear(x, module.weight, module.bias)  # (..., d)
        if tangents is None:
            return y, None
        target = tangents.get(module)
        dy = None if dx is None else F.linear(dx, module.weight)  # dX W^T (the bias has no tangent)
        if target is not None:
            layer, u = target
            # -(X A^T) U^T, in the activations' dtype (departure 1), U gathered for this layer only.
            # Shapes: (N, k) @ (k, r) -> (N, r); (N, r) @ (r, d) -> (N, d)
            p = x.reshape(-1, x.shape[-1]) @ layer.projection_as(x.dtype).t()
            pu = (p @ layer.all_rows(u).to(x.dtype).t()).reshape(y.shape)  # (X A^T) U^T
            dy = pu.neg_() if dy is None else dy.sub_(pu)
        return y, dy

    h = decoder.embed_tokens(input_ids)  # (B, T, h); the embedding is frozen: no tangent
    dh = None
    B, T = input_ids.shape
    positions = torch.arange(T, device=h.device)[None]  # (1, T), as the model's own forward
    cos, sin = decoder.rotary_emb(h, positions)  # (1, T, hd) each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    # The additive mask, as transformers forms it: 0 where key j <= query i (and j not padding), else
    # the dtype's min. Formed only where it is read: by the tangent's softmax, and by the fused
    # kernel for a padded batch (unpadded, its own causal mask serves: is_causal).
    mask = None
    if tangents is not None or attention_mask is not None:
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[None, None]  # (1, 1, T, T)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
        mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill_(~allowed,
                                                                                         torch.finfo(h.dtype).min)
    fused_mask = None if attention_mask is None else mask
    for block in decoder.layers:
        gathered = hasattr(block, "unshard")  # an FSDP2 unit: its weights gathered for this layer only
        if gathered:
            block.unshard()
        attn, mlp = block.self_attn, block.mlp
        # --- attention
        x, dx = _rms_norm(block.input_layernorm, h, dh)
        shape = (B, T, -1, attn.head_dim)
        (q, dq), (k, dk), (v, dv) = (linear(m, x, dx) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, dq, k, dk, v, dv = (None if t is None else t.view(shape) for t in (q, dq, k, dk, v, dv))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of every head's q and k
            q, dq = _rms_norm(attn.q_norm, q, dq)
            k, dk = _rms_norm(attn.k_norm, k, dk)
        q, dq, k, dk, v, dv = (None if t is None else t.transpose(1, 2) for t in (q, dq, k, dk, v, dv))  # (B, H, T, hd)
        q, dq = _rotary(q, dq, cos, sin)
        k, dk = _rotary(k, dk, cos, sin)
        groups = attn.num_key_value_groups
        k, dk, v, dv = (None if t is None else t.repeat_interleave(groups, dim=1) for t in (k, dk, v, dv))
        # O = softmax(q k^T s + mask) v by torch's fused attention: no (B, H, T, T) tensor
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=fused_mask, is_causal=fused_mask is None,
                                           scale=attn.scaling)  # (B, H, T, hd)
        do = None
        if dq is not None or dk is not None or dv is not None:
            dq, dk, dv = (torch.zeros_like(t) if dt is None else dt for t, dt in ((q, dq), (k, dk), (v, dv)))
            # dO = dP v + P dv with dP = P (dS - c), c = sum_j P dS, dS = (dq k^T + q dk^T) s: P and dS
            # formed, dP in dS's place; P dv by the fused attention
            scores = torch.matmul(q * attn.scaling, k.transpose(2, 3)).add_(mask)  # (B, H, T, T)
            p32 = torch.softmax(scores, dim=-1, dtype=torch.float32)  # (B, H, T, T) fp32
            del scores
            ds = torch.matmul(torch.cat([dq, q], dim=-1) * attn.scaling,
                              torch.cat([k, dk], dim=-1).transpose(2, 3))  # (B, H, T, T): dq k^T s + q dk^T s
            c = (p32 * ds).sum(-1, keepdim=True)  # (B, H, T, 1) fp32
            dp = (ds - c).mul_(p32)  # (B, H, T, T) fp32
            del ds, p32
            do = torch.matmul(dp.to(v.dtype), v) + F.scaled_dot_product_attention(
                q, k, dv, attn_mask=fused_mask, is_causal=fused_mask is None, scale=attn.scaling)
            del dp
        o = o.transpose(1, 2).reshape(B, T, -1)
        do = None if do is None else do.transpose(1, 2).reshape(B, T, -1)
        y, dy = linear(attn.o_proj, o, do)
        h, dh = h + y, _plus(dh, dy)
        # --- MLP: down(silu(gate(x)) * up(x))
        x, dx = _rms_norm(block.post_attention_layernorm, h, dh)
        (g, dg), (u, du) = linear(mlp.gate_proj, x, dx), linear(mlp.up_proj, x, dx)
        a = F.silu(g)
        # d silu(g) = dg sig(g) (1 + g (1 - sig(g))): SiLU's own derivative kernel, applied to dg
        da = None if dg is None else torch.ops.aten.silu_backward(dg, g)
        m, dm = a * u, _plus(None if da is None else da * u, None if du is None else a * du)
        y, dy = linear(mlp.down_proj, m, dm)
        h, dh = h + y, _plus(dh, dy)
        if gathered:
            block.reshard()
    return _rms_norm(decoder.norm, h, dh)


@torch.no_grad()
def fast_probe(model, layers, directions, input_ids, response_mask, *, temperature=1.0, max_responses=None,
               min_tokens=PROBE_FLOOR, max_tokens=MAX_TOKENS, attention_mask=None, keep_positions=0,
               group=None) -> Probe:
    """KL1, the mean second-order KL per generated token for the direction alpha = 1, from one
    forward pass with tangents over this process's probed responses: the fast path (above), the
    same numbers as `plain_probe`. Weights are not touched.

    `directions`: RowAdam's U, one (d, r) per layer of `layers` (this process's (n, r) rows of a
    row-sharded layer), as `opt.prepare()` leaves them in `opt.directions`. `response_mask`
    (B, T) marks generated tokens; the token at t is scored on the logits at t - 1, at
    `temperature` (the sampling one). Probed: the first 2 responses and more until they hold
    `min_tokens` scored tokens (all of them if they hold fewer; departure 3), or, given
    `max_responses`, exactly the first `max_responses`; each cut to its first `max_tokens` tokens.
    `keep_positions` > 0 keeps the logits (the forward's primal) at the first `keep_positions`
    scored positions, or at all of them when there are fewer (`Probe.kept` says how many): the
    "before" of `realised_kl`, at no extra forward. Every trainer process must call this (FSDP
    all-gathers inside).
    """
    _check_probe_inputs(layers, directions, temperature, keep_positions)
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    decoder = model.get_decoder()
    # (sum kl1, scored positions, sum entropy, probed responses, rows whose mask covers position 0)
    total = torch.zeros(5, dtype=torch.float64, device=ids.device)
    total[3] = ids.shape[0]
    total[4] = response_mask[:, 0].bool().sum()  # read with the sums below: no host read of its own
    kept = []
    with _root_gathered(model), contextlib.ExitStack() as stack:
        if _written_out(model, ids.shape[1]):  # the decoder and its tangent written out (above)
            tangents = {layer.module: (layer, u) for layer, u in zip(layers, directions)}
            hidden, tangent = written_decoder(model, ids, am, tangents)
        else:  # forward-mode AD through the model's own decoder (in eval mode, eager attention), tangents injected
            for context in (probe_mode(model), injected_tangents(layers, directions), _dual_level(),
                            _ConstantOperands()):
                stack.enter_context(context)
            hidden, tangent = fwAD.unpack_dual(decoder(input_ids=ids, attention_mask=am,
                                                       use_cache=False).last_hidden_state)
        if tangent is None:
            raise RuntimeError("the tangent was lost in the decoder (an op without forward AD?)")
        # (M, h) each: the positions that sampled a generated token
        hidden, tangent = hidden[:, :-1][scored], tangent[:, :-1][scored]
        for z, u in _head_chunks(model, hidden, tangent):
            kl = token_kl(z, u, temperature)  # (c,)
            total[0] += kl.sum()
            total[1] += kl.numel()
            total[2] += token_entropy(z, temperature).sum()
            need = keep_positions - sum(len(k) for k in kept)
            if need > 0:  # a part of a chunk is copied, so that the chunk itself is freed
                kept.append(z[:need].clone() if need < len(z) else z)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count, entropy_sum, responses, first = total.tolist()
    _check_first_position(int(first))  # on every process alike: the counts are reduced
    if count == 0:
        raise ValueError(NO_TOKEN)
    logits = torch.cat(kept) if keep_positions > 0 else None  # (kept, V)
    return Probe(kl_sum / count, logits, 0 if logits is None else logits.shape[0], ids.shape[0], max_tokens,
                 float(temperature), entropy_sum / count, count / responses)


# The probe to call: the fast path.
probe = fast_probe


def predict_kl(model, layers, directions, input_ids, response_mask, **kwargs) -> float:
    """KL1 alone: `probe(...).kl1`."""
    return probe(model, layers, directions, input_ids, response_mask, **kwargs).kl1


# -----------------------------------------------------------------------------
# The realised KL of a merged step

@torch.no_grad()
def scored_logits(model, input_ids, response_mask, *, max_responses=None, min_tokens=PROBE_FLOOR,
                  max_positions=512, max_tokens=MAX_TOKENS, attention_mask=None) -> torch.Tensor:
    """The policy's logits (M', V) at the probe's first `max_positions` scored positions (all of
    them when there are fewer), the probe's arguments choosing the positions, by the probe's path
    without tangents (eager attention, the decoder, the head on those rows): the same numbers as
    the probe's own primal for the same weights, bit for bit."""
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    with _root_gathered(model):
        if _written_out(model, ids.shape[1]):  # the probe's own primal, op for op the model's
            hidden, _ = written_decoder(model, ids, am)
        else:
            with probe_mode(model):
                hidden = model.get_decoder()(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        return torch.cat([z for z, _ in _head_chunks(model, hidden[:, :-1][scored][:max_positions])])


@torch.no_grad()
def realised_kl(probe, model, input_ids, response_mask, *, attention_mask=None, group=None, temperature=None,
                max_responses=None, max_tokens=None) -> float:
    """Exact KL(pi_old || pi_new) per scored token, full vocabulary, in float64 (a step's KL is
    far below fp32's resolution of a log-prob), at the positions whose logits `probe` kept
    before the merge, reduced across processes: what the prediction alpha^2 KL1 stands for.

    `probe` is the `Probe` that `probe(...)` returned before the merge: it records the
    responses, token limit and temperature it scored and the logits it kept, so pass the same
    `input_ids`, `response_mask` (and `attention_mask`) and nothing else. It must have kept
    logits (`keep_positions` > 0). `temperature`, `max_responses` and `max_tokens` are for the
    older form, `realised_kl(probe.logits, ...)`, which repeats the probe's arguments by hand
    (defaults: the probe's); given with a Probe, each must be the probe's own. Inputs that do
    not give the kept positions back are refused, before any collective.
    """
    if isinstance(probe, torch.Tensor):  # the older form: the kept logits, with the probe's arguments repeated
        limit = MAX_TOKENS if max_tokens is None else max_tokens
        temperature = 1.0 if temperature is None else temperature
        _check_temperature(temperature)
        ids, _, _ = _scored(input_ids, response_mask, max_responses, PROBE_FLOOR, limit, attention_mask)
        probe = Probe(math.nan, probe, probe.shape[0], ids.shape[0], limit, temperature)
    elif isinstance(probe, Probe):
        given = (("temperature", temperature, probe.temperature), ("max_tokens", max_tokens, probe.max_tokens),
                 ("max_responses", None if max_responses is None else min(max_responses, len(input_ids)),
                  probe.responses))
        for name, value, own in given:
            if value is not None and value != own:
                raise ValueError(f"realised_kl got {name}={value}, but the probe scored with {name}={own}: "
                                 f"drop the argument (the Probe records it)")
    elif probe is not None:
        raise TypeError(f"realised_kl takes the Probe that probe(...) returned, got {type(probe).__name__}")
    if probe is None or probe.logits is None:
        raise ValueError("the probe kept no logits (keep_positions=0), so there is no 'before' to compare with: "
                         "pass keep_positions > 0 to probe(...)")
    new_logits = scored_logits(model, input_ids, response_mask, max_responses=probe.responses,
                               max_positions=probe.kept, max_tokens=probe.max_tokens,
                               attention_mask=attention_mask)  # (kept, V)
    if new_logits.shape != probe.logits.shape:
        raise ValueError(f"the probe kept logits {tuple(probe.logits.shape)}, but these inputs give "
                         f"{tuple(new_logits.shape)} at its positions: pass the probe's own input_ids, "
                         f"response_mask and attention_mask (and, in the older form, its max_responses)")
    total = torch.zeros(2, dtype=torch.float64, device=new_logits.device)
    for start in range(0, new_logits.shape[0], KL_CHUNK_POSITIONS):
        stop = start + KL_CHUNK_POSITIONS
        old = torch.log_softmax(probe.logits[start:stop].double() / probe.temperature, dim=-1)  # (c, V)
        new = torch.log_softmax(new_logits[start:stop].double() / probe.temperature, dim=-1)
        # KL = sum_v p_old (log p_old - log p_new)
        total[0] += (old.exp() * (old - new)).sum()
        total[1] += old.shape[0]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count = total.tolist()
    return kl_sum / count if count else 0.0


# -----------------------------------------------------------------------------
# Step size, budget schedule, mismatch subtraction

def solve_alpha(kl1, *, budget, alpha_max=3.0) -> float:
    """alpha = min(alpha_max, sqrt(budget / KL1)); KL1 == 0 gives 1.0 capped at alpha_max (departure 2)."""
    kl1 = float(kl1)
    if not math.isfinite(kl1) or kl1 < 0:
        raise ValueError(f"predicted KL must be finite and >= 0, got {kl1}: refusing an uncontrolled update")
    if not (math.isfinite(budget) and budget > 0) or not alpha_max > 0:
        raise ValueError(f"need budget > 0 and alpha_max > 0, got {budget}, {alpha_max}")
    if kl1 == 0.0:
        return min(1.0, alpha_max)
    return min(alpha_max, math.sqrt(budget / kl1))


def budget_for(probe, *, entropy_share=ENTROPY_SHARE, per_response=PER_RESPONSE) -> float:
    """The default KL budget of one update, in nats per generated token, read from its probe:

        budget = min(entropy_share * H, per_response / L)

    H the policy's mean entropy per scored token, L the scored tokens per probed response
    (`Probe.entropy`, `Probe.tokens_per_response`). Why, and what it gives from a toy to the
    paper's 7B: the module docstring's "Defaults". Constant settings, no horizon: the policy's
    own entropy shrinks the budget as it grows sure."""
    if not isinstance(probe, Probe):
        raise TypeError(f"budget_for takes the Probe that probe(...) returned, got {type(probe).__name__}")
    if not (entropy_share > 0 and per_response > 0):
        raise ValueError(f"need entropy_share > 0 and per_response > 0, got {entropy_share}, {per_response}")
    if not (math.isfinite(probe.entropy) and math.isfinite(probe.tokens_per_response)):
        raise ValueError("this Probe carries no entropy or response length (made by the older realised_kl form): "
                         "pass the Probe that probe(...) returned")
    budget = min(entropy_share * probe.entropy, per_response / probe.tokens_per_response)
    # A policy sure of every token (entropy 0) gets the smallest positive budget, not 0: solve_alpha needs > 0.
    return max(budget, 1e-12)


def kl_budget(update, *, start, end, horizon) -> float:
    """Cosine schedule in nats per generated token, from `start` (update 0) to `end` (update
    horizon - 1 and later): the paper's form (its 7B run: start 2e-4, end 2e-5, horizon 300).
    All three are given: the horizon is the run's length, which only the caller knows."""
    if update < 0 or horizon < 2:
        raise ValueError(f"need update >= 0 and horizon >= 2, got {update}, {horizon}")
    if not (start > 0 and end > 0):
        raise ValueError(f"need start > 0 and end > 0 (nats per token), got {start}, {end}")
    w = 0.5 * (1.0 + math.cos(math.pi * min(update / (horizon - 1), 1.0)))  # 1 -> 0
    return w * start + (1.0 - w) * end


class Mismatch:
    """EMA m of the engine-vs-trainer log-prob gap on the responses that count; shrinks the budget."""

    def __init__(self, momentum=0.7):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.m = 0.0
        self.active = False  # whether a response of the last observed global batch counted

    @torch.no_grad()
    def observe(self, rollout_logprobs, trainer_logprobs, response_mask, ended_with_eos=None, group=None):
        """observed = max(0, mean(rollout - trainer)) over the response tokens of the responses
        that count, summed and counted across processes; m <- 0.7 m + 0.3 observed.

        `ended_with_eos` (B,) bool: only responses that ended with EOS count (the paper's rule);
        None: every response counts (fixed-length responses, which never end with EOS;
        departure 4). Returns the observed value. A global batch in which no response counts
        (none ended with EOS, or no response token) returns None and leaves the estimate m as it
        was; `adjust` then leaves this update's budget whole, and the next batch in which one
        counts subtracts again.
        """
        if not (rollout_logprobs.shape == trainer_logprobs.shape == response_mask.shape):
            raise ValueError("rollout log-probs, trainer log-probs and mask must have one shape (B, T)")
        counts = response_mask.bool()  # (B, T)
        if ended_with_eos is not None:
            if ended_with_eos.shape != response_mask.shape[:1]:
                raise ValueError(f"ended_with_eos must be ({response_mask.shape[0]},), or None to count every "
                                 f"response, got {tuple(ended_with_eos.shape)}")
            counts = counts & ended_with_eos.bool()[:, None]  # (B, T)
        gap = (rollout_logprobs.double() - trainer_logprobs.double())[counts]  # (M,)
        if not torch.isfinite(gap).all():
            raise FloatingPointError("non-finite log-probs in the mismatch estimate")
        total = torch.stack([gap.sum(), torch.tensor(float(gap.numel()), dtype=torch.float64,
                                                     device=gap.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=group)
        gap_sum, count = total.tolist()
        self.active = count > 0
        if count == 0:
            return None
        observed = max(0.0, gap_sum / count)
        self.m = self.momentum * self.m + (1.0 - self.momentum) * observed
        return observed

    def adjust(self, budget) -> float:
        """budget <- max(budget - m, 0.5 budget); unchanged when no response of the last observed
        global batch counted (then m was not updated either, as in the authors' code linked in
        the module docstring)."""
        return max(budget - self.m, 0.5 * budget) if self.active else budget

    def state_dict(self):
        return {"m": self.m, "momentum": self.momentum}

    def load_state_dict(self, state):
        self.m, self.momentum = float(state["m"]), float(state["momentum"])


class Calibration:
    """The scale rho of the KL prediction, learnt from the realised KL of past updates, so that the
    budget is spent in realised KL rather than in predicted KL:

        ratio = clamp(realised / predicted, 1/10, 10)        one update where the budget bound
        log rho <- 0.7 log rho + 0.3 log ratio                a moving geometric mean; rho = 1 at first
        alpha  = min(alpha_max, sqrt(budget / (rho KL1)))     the next update's step (`adjust(kl1)`)

    `predicted` is the prediction alpha^2 KL1 without rho. Only updates with alpha < alpha_max
    are observed: at the cap the budget did not set the step. Why (the module docstring's
    "Calibration" and departure 5): the prediction is second order, and on the small loops of
    bench/README.md (`defaults_why`) a budget-bound step realised about half of it, so steps
    spent half the budget they were given. The fixed point of the rule is a realised KL equal to the
    budget, and the clamp bounds what one update can change: alpha moves by at most sqrt(10)
    over the raw controller's. State: `log_scale`, checkpointed with the optimizer."""

    def __init__(self, momentum=0.7, low=0.1, high=10.0):
        if not 0.0 <= momentum < 1.0 or not 0.0 < low <= 1.0 <= high:
            raise ValueError(f"need 0 <= momentum < 1 and 0 < low <= 1 <= high, got {momentum}, {low}, {high}")
        self.momentum, self.low, self.high = momentum, low, high
        self.log_scale = 0.0

    @property
    def scale(self) -> float:
        return math.exp(self.log_scale)

    def observe(self, realised, predicted):
        """One update's realised KL against its prediction (alpha^2 KL1, no rho), both per token.
        Returns the clamped ratio, or None when there is nothing to learn (a prediction of 0, a
        realised KL that is not finite): the scale is then left as it was."""
        realised, predicted = float(realised), float(predicted)
        if not (math.isfinite(realised) and math.isfinite(predicted) and predicted > 0):
            return None
        ratio = min(max(realised / predicted, self.low), self.high)
        self.log_scale = self.momentum * self.log_scale + (1.0 - self.momentum) * math.log(ratio)
        return ratio

    def adjust(self, kl1) -> float:
        """KL1 scaled by rho: what `solve_alpha` takes."""
        return float(kl1) * self.scale

    def state_dict(self):
        return {"log_scale": self.log_scale, "momentum": self.momentum, "low": self.low, "high": self.high}

    def load_state_dict(self, state):
        self.log_scale, self.momentum = float(state["log_scale"]), float(state["momentum"])
        self.low, self.high = float(state["low"]), float(state["high"])


def probe_count(mask, responses: int, tokens: int) -> int:
    """How many of this process's responses to probe: the first `responses` (the paper's 2), and
    more until they hold at least `tokens` generated tokens (all of them if they hold fewer);
    `mask` (B, T) marks the generated tokens. The probe's default is this rule with 2 and 512
    (departure 3): the paper's responses run to thousands of tokens, where it gives the paper's
    2; on short responses KL1 from 2 of them would be noise. `tokens=0` gives the paper's 2."""
    per_response = mask.sum(dim=1).tolist()  # generated tokens of each response
    count, seen = 0, 0
    for n in per_response:
        if count >= responses and seen >= tokens:
            break
        count, seen = count + 1, seen + n
    return max(count, min(responses, len(per_response)))


# -----------------------------------------------------------------------------
# The whole update as one torch.optim step

def _pad_token_id(model):
    """The model's pad token id (its generation config's, else its config's), or None."""
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return None


class LoGRAOptimizer(torch.optim.Optimizer):
    """LoGRA as one `torch.optim` optimizer: the module docstring's Use block, one `step` a batch.

        opt = kl_control.LoGRAOptimizer(model, RowAdam(sketch.attach(model, seed=0)))
        loss.backward()                                  # into the sketches S = G A^T
        opt.step(ids, mask)                              # RowAdam, probe, alpha, merge: one update
        opt.zero_grad()                                  # nothing to zero; kept for the loop's shape

    `rowadam`: a RowAdam (rowadam.py) over the sketched layers of `model`; this file imports
    neither, so that it copies alone. `step(ids, mask, attention_mask=None)`, after the batch's
    backward (or its micro-batches'): `RowAdam.prepare(per_layer=per_layer)`, the probe on
    (ids, mask), the budget (`budget_for(probe)` by default, or the paper's `kl_budget` schedule
    when `kl_start`, `kl_end` and `horizon` are given; less `mismatch`'s estimate when its
    `observe` saw a batch), `solve_alpha`, `RowAdam.merge`. With calibration, alpha is solved on
    KL1 times the calibration's rho and the realised KL after the merge teaches rho (the module
    docstring's "Calibration"; departure 5).

    `start` picks the defaults of `per_layer`, `alpha_max`, `entropy_share` and `calibrate`
    (each one given wins over its start's; STARTS; the module docstring's "The one-call form's
    defaults"):
    - "pretrained": the paper's controller, bit for bit the README's three calls (RowAdam's
      one scale, alpha_max 3, budget_for's entropy_share 0.2, no calibration;
      tests/test_kl_control.py::test_the_one_call_optimizer_is_the_three_calls_bitwise).
    - "scratch": for random weights: RowAdam's step scaled per layer (departure 6), alpha_max
      OPTIMIZER_ALPHA_MAX (9), entropy_share OPTIMIZER_ENTROPY_SHARE (0.4), calibrated
      (departure 5): its first update is the same calls' with those settings, and the later
      ones differ only by rho.
    - "auto" (the default): `model_start(model)`: "pretrained" for a transformers model loaded
      with `from_pretrained` (its config names where from), "scratch" for one built from a
      config; a model without a transformers config takes "scratch" and one UserWarning, at the
      caller's line, names `start`. It reads how the model was made: a random model built with
      `from_config` from a loaded config, or trained weights put in with `load_state_dict`,
      need `start` given. `opt.start` says which was taken.

    A trainer that calls `step()` without arguments (TRL's) sets `opt.batch = (ids,
    attention_mask, mask)` before it. `mask` (B, T): True on the generated tokens, never on a
    row's first position (no log-prob there).
    Refusals: a batch the probe cannot score (ids and mask of different shapes, a mask on a
    row's first position, no generated token), or one padded on the left, as `model.generate`
    pads prompts, given without its `attention_mask` (rows that begin with more of the model's
    pad token than others: `left_padded_rows`; `check_batch`) is refused before anything is
    computed, and nothing changes, the sketches included: call `step` again with the corrected
    batch, without a new backward. A failure after that (a non-finite sketch, the probe, the
    budget) discards the batch: weights, moments and counter as they were, the sketches zeroed,
    the error raised; the next batch needs its own backward.

    Micro-batches (gradient accumulation): run each micro-batch's backward with its loss divided
    by the whole batch's response tokens (`ppo.policy_loss(..., num_tokens=n)` with n the token
    count of all micro-batches together, `ppo.global_token_count` over processes), so that the
    sketches sum to the batch's; then one `step(ids, mask)` with the whole batch's ids and mask
    (rows stacked, padded to one length, with its `attention_mask`), whose first eighth the probe
    scores (at least 128 tokens). Given one micro-batch instead, it scores that one's eighth.

    `entropy_share` and `per_response`: `budget_for`'s, for the default budget. `per_layer`
    True: RowAdam's step scaled per layer, `RowAdam.prepare(per_layer=True)`; False: the
    paper's one scale for all layers.

    `last` holds the step's `alpha`, `budget`, `kl_predicted` (alpha^2 KL1, without rho),
    `entropy` (the probe's, nats per token), `kl_scale` (the rho its alpha used; 1.0 without
    calibration) and, with `keep_positions` > 0 (CALIBRATION_POSITIONS by default when it
    calibrates, 0 when not), `kl_realised`; `log(name, value)`
    receives them too, as `logra/<key>`. When alpha has sat at `alpha_max` for CAPPED_UPDATES
    updates in a row, one `UserWarning` per optimizer, at the caller's line, says the budget does
    not bind and names the knob (RowAdam's `update_ratio`). `state_dict()` holds RowAdam's
    (moments, update counter, settings), the mismatch estimate, the calibration's rho and that
    count (a state saved with the other `calibrate` or `per_layer` is refused, before anything
    is loaded, the refusal naming `start`; one saved before calibration existed starts rho at 1, and one saved before
    `per_layer` existed was saved with one scale); on a resume its
    update counter, not `attach(update=)`, picks the projection (`RowAdam.load_state_dict`).

    One param group of the target weights with `lr` 0.0, for schedulers and loggers that read
    it: LoGRA's step size is the KL budget's, and `lr` is not read. `temperature`: the sampling
    one; `group`: processes whose whole sketches are summed in prepare (the paper's all_reduce).
    """

    def __init__(self, model, rowadam, *, start="auto", temperature=1.0, alpha_max=None, kl_start=None, kl_end=None,
                 horizon=None, entropy_share=None, per_response=PER_RESPONSE, calibrate=None, per_layer=None,
                 keep_positions=None, max_responses=None, group=None, log=None):
        if start not in ("auto", *STARTS):
            raise ValueError(f"start must be 'auto', 'pretrained' or 'scratch', got {start!r}")
        unknown = False  # True: "auto" found no transformers config to read (said at the end)
        if start == "auto":
            start = model_start(model)
            unknown, start = start is None, start or "scratch"
        given = {"per_layer": per_layer, "alpha_max": alpha_max, "entropy_share": entropy_share, "calibrate": calibrate}
        settings = {k: STARTS[start][k] if v is None else v for k, v in given.items()}  # a given value wins
        per_layer, alpha_max, entropy_share, calibrate = (settings[k] for k in given)
        schedule = (kl_start, kl_end, horizon)
        if any(v is not None for v in schedule) and any(v is None for v in schedule):
            raise ValueError("the paper's budget schedule needs kl_start, kl_end and horizon (the run's updates) "
                             "together; leave all three out for the default budget (budget_for)")
        _check_temperature(temperature)
        if keep_positions is None:
            keep_positions = CALIBRATION_POSITIONS if calibrate else 0
        if not alpha_max > 0 or not keep_positions >= 0:
            raise ValueError(f"need alpha_max > 0 and keep_positions >= 0, got {alpha_max}, {keep_positions}")
        if calibrate and keep_positions == 0:
            raise ValueError("calibrate=True learns from the realised KL, which needs the probe's logits: pass "
                             "keep_positions > 0 (or leave it out), or calibrate=False")
        if not (entropy_share > 0 and per_response > 0):
            raise ValueError(f"need entropy_share > 0 and per_response > 0 (budget_for's), got {entropy_share}, "
                             f"{per_response}")
        if not all(hasattr(rowadam, a) for a in ("prepare", "merge", "discard", "directions", "layers")):
            raise TypeError(f"LoGRAOptimizer(model, rowadam) takes a RowAdam (rowadam.py) over the model's "
                            f"sketched layers, got {type(rowadam).__name__}")
        layers = rowadam.layers
        super().__init__([layer.module.weight for layer in layers], {"lr": 0.0})
        self.model, self.rowadam, self.layers, self.group, self.start = model, rowadam, layers, group, start
        self.temperature, self.alpha_max, self.schedule = float(temperature), float(alpha_max), schedule
        self.keep_positions, self.max_responses = keep_positions, max_responses
        self.mismatch = Mismatch()  # observe(...) it before step when another engine sampled the batch
        self.calibration = Calibration() if calibrate else None  # the prediction's scale, from realised KLs
        self.per_layer = bool(per_layer)  # RowAdam's scale: one c per layer, or the paper's one for all
        self.log = log or (lambda name, value: None)
        self.batch = None  # (ids, attention_mask, mask), for a trainer that calls step() without arguments
        self.last, self.factors = {}, None
        self.cap = CapWatch(alpha_max)  # updates in a row at the cap, and whether that was said
        self.shares = {"entropy_share": entropy_share, "per_response": per_response}  # budget_for's
        if unknown:  # said once the constructor has accepted everything, at the caller's line
            warnings.warn(UNKNOWN_START, stacklevel=_caller_stacklevel())

    @property
    def update(self) -> int:
        return self.rowadam.update

    @property
    def capped(self) -> int:
        """Updates in a row with alpha at alpha_max, up to now."""
        return self.cap.capped

    def zero_grad(self, set_to_none=True):
        """Nothing to zero: no target weight has a gradient, and `merge` zeroed the sketches."""

    @torch.no_grad()
    def step(self, ids=None, mask=None, attention_mask=None, *, closure=None):
        if closure is not None:
            raise ValueError("LoGRAOptimizer.step takes no closure: run the backward, then step(ids, mask)")
        if ids is None:
            if self.batch is None:
                raise RuntimeError("step() needs the batch its backward ran on: step(ids, mask), or set "
                                   "opt.batch = (ids, attention_mask, mask) first")
            ids, attention_mask, mask = self.batch
        elif mask is None:
            raise ValueError("step(ids, mask): the response mask (B, T) is needed with the ids")
        self.batch = None
        try:  # what the probe would refuse, refused first: nothing changed, the sketches still hold the batch
            check_batch(ids, mask, attention_mask=attention_mask, max_responses=self.max_responses, group=self.group,
                        pad_token_id=_pad_token_id(self.model))
        except ValueError as e:
            raise ValueError(f"{e} (nothing was changed: the sketches still hold the batch's backward, so call "
                             f"step again with the corrected batch, without a new backward)") from None
        opt = self.rowadam
        try:
            opt.prepare(self.group, per_layer=self.per_layer)  # U = c D per layer (d, r); nothing changed yet
            probe = fast_probe(self.model, self.layers, opt.directions, ids, mask, temperature=self.temperature,
                               max_responses=self.max_responses, attention_mask=attention_mask,
                               keep_positions=self.keep_positions, group=self.group)
            kl_start, kl_end, horizon = self.schedule
            budget = budget_for(probe, **self.shares) if kl_start is None else \
                kl_budget(opt.update, start=kl_start, end=kl_end, horizon=horizon)
            budget = self.mismatch.adjust(budget)
            scale = self.calibration.scale if self.calibration else 1.0
            alpha = solve_alpha(probe.kl1 * scale, budget=budget, alpha_max=self.alpha_max)
        except BaseException:
            opt.discard()  # nothing merged: weights, moments and counter as they were
            raise
        self.factors = opt.merge(alpha)  # W -= F A_t, F = bf16(alpha U): what an engine would receive
        self.last = {"alpha": alpha, "budget": budget, "kl_predicted": alpha**2 * probe.kl1,
                     "entropy": probe.entropy, "kl_scale": scale}
        if self.keep_positions:
            self.last["kl_realised"] = realised_kl(probe, self.model, ids, mask, attention_mask=attention_mask,
                                                   group=self.group)
            if self.calibration and alpha < self.alpha_max:  # the budget set this step: learn its prediction's scale
                self.calibration.observe(self.last["kl_realised"], self.last["kl_predicted"])
        for name, value in self.last.items():
            self.log(f"logra/{name}", value)
        if self.cap.see(alpha):
            warnings.warn(capped_message(self.capped, self.alpha_max, self.rowadam.update_ratio),
                          stacklevel=_caller_stacklevel())

    def state_dict(self) -> dict:
        """RowAdam's state (moments, update counter, settings), the mismatch estimate, the
        calibration's state (None without it), the count of updates at the cap and which
        warnings were said: what a checkpoint saves and resumes."""
        return {"rowadam": self.rowadam.state_dict(), "mismatch": self.mismatch.state_dict(),
                "capped": self.cap.capped, "warned": self.cap.said,
                "calibration": self.calibration.state_dict() if self.calibration else None,
                "per_layer": self.per_layer}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("calibration")  # None: saved without calibration, or before it existed
        if (saved is not None) != (self.calibration is not None) and "calibration" in state:  # before any change
            raise ValueError(f"this state was saved with calibrate={saved is not None}, and this optimizer has "
                             f"calibrate={self.calibration is not None} (start={self.start!r}): make them the same "
                             f"to resume (start='scratch' calibrates and scales per layer, 'pretrained' does neither)")
        per_layer = state.get("per_layer", False)  # a state from before the option: RowAdam's one scale
        if per_layer != self.per_layer:
            raise ValueError(f"this state was saved with per_layer={per_layer}" +
                             (" (saved before the option existed, with RowAdam's one scale for all layers)"
                              if "per_layer" not in state else "") +
                             f", and this optimizer has per_layer={self.per_layer} (start={self.start!r}): make them "
                             f"the same to resume (start='scratch' scales per layer, 'pretrained' does not)")
        self.rowadam.load_state_dict(state["rowadam"])
        self.mismatch.load_state_dict(state["mismatch"])
        self.cap.capped, self.cap.said = int(state["capped"]), bool(state["warned"])
        if self.calibration is not None and saved is not None:
            self.calibration.load_state_dict(saved)
        elif self.calibration is not None:  # a state from before calibration existed: rho starts at 1
            self.calibration.log_scale = 0.0


def model_start(model) -> str | None:
    """Where `model`'s weights start, as LoGRAOptimizer's `start="auto"` reads it: "pretrained"
    when its transformers config names where they were loaded from (`from_pretrained` records
    it in `config.name_or_path`), "scratch" when its config names nothing (a model built from a
    config), None without such a config (a wrapper's `.module` is looked through). It reads
    how the model was made, not its weights: `from_config` keeps the name of a config that
    was itself loaded, and weights loaded with `load_state_dict` leave the name empty."""
    for m in (model, getattr(model, "module", None)):
        name = getattr(getattr(m, "config", None), "name_or_path", None)
        if isinstance(name, str):
            return "pretrained" if name else "scratch"
    return None


UNKNOWN_START = ("LoGRAOptimizer: this model has no transformers config to tell whether its weights were trained, "
                 "so it takes the settings for random weights (start='scratch': RowAdam's step scaled per layer, "
                 f"alpha_max {STARTS['scratch']['alpha_max']:g}, entropy_share {STARTS['scratch']['entropy_share']:g}, "
                 "calibrated). For trained weights pass start='pretrained' (the "
                 "paper's controller, the README's three calls: on the one pretrained model measured, SmolLM2-135M-Instruct, "
                 "it took held-out pass@1 from 0.17 to 0.58-0.79 in 3 runs of 3, these settings to 0.21-0.87, above "
                 "0.5 in 1 of 3; bench/README.md, defaults_smollm2). Pass start='scratch' to silence this.")


def _caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside this file and torch, for a warning raised in
    this file: the caller's own line, past the frames torch adds around an optimizer's `step`
    (`torch.no_grad()`'s wrapper, the optimizer's hook wrapper, an LR scheduler's counter)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frame, level = sys._getframe(1), 1  # the function that warns: stacklevel 1
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith(torch_dir)):
        frame, level = frame.f_back, level + 1
    return level


class CapWatch:
    """The updates in a row with alpha at alpha_max (`capped`); `see(alpha)` counts one and is
    True once, when the count first reaches CAPPED_UPDATES: when LoGRAOptimizer warns and
    train.py logs `capped_message`."""

    def __init__(self, alpha_max):
        self.alpha_max, self.capped, self.said = alpha_max, 0, False

    def see(self, alpha) -> bool:
        self.capped = self.capped + 1 if alpha >= self.alpha_max else 0
        if self.capped < CAPPED_UPDATES or self.said:
            return False
        self.said = True
        return True


def capped_message(updates, alpha_max, update_ratio) -> str:
    """The warning for alpha at its cap, LoGRAOptimizer's and train.py's one line. What it
    advises is what was measured (the module docstring's "What to watch"): raising update_ratio
    there hands the step to the budget, and on the loop measured where the cap bound throughout
    that lowered the held-out score (where it bound now and then, 3x moved it by 0.03 at most on
    the toy and within the spread on the 64-token loop),
    so it says to change update_ratio only on a held-out metric."""
    return (f"alpha has been at its cap alpha_max={alpha_max:g} for {updates} updates in a row: the KL budget "
            f"does not bind, and each step is update_ratio's ({alpha_max:g} x {update_ratio:g} of ||W||), not the "
            f"budget's. Common where a small change of the weights barely moves the outputs (a random init at a "
            f"small std); there, raising update_ratio (RowAdam's, now {update_ratio:g}) hands the step to the "
            f"budget, which made held-out scores worse where the cap bound throughout (bench/README.md, defaults), "
            f"so change it, in either direction, only if a held-out metric says so")

"""
examples/trl_grpo.py: LoGRA inside TRL's GRPOTrainer, beside TRL's own AdamW.

    pip install -e ".[trl]"                           # trl==1.16.0 (datasets, accelerate)
    python examples/trl_grpo.py                       # both optimizers, 30 steps each, a CPU toy
    python examples/trl_grpo.py --optimizer logra     # one of them (--optimizer adamw: TRL's own AdamW)
    python examples/trl_grpo.py --steps 10            # fewer

LoGRA replaces the optimizer and nothing else: TRL still samples, scores, builds its GRPO loss
and calls `loss.backward()` and `optimizer.step()` where it always does. `LoGRAGRPOTrainer`
overrides two methods of `GRPOTrainer`:
- `create_optimizer`, which TRL's Trainer calls once the model is placed, attaches the sketches
  (sketch.py: every weight frozen, the attention/MLP projections sketched, fp32 master
  weights) and returns infra/one_call.py's `LoGRAOptimizer` (kl_control.py's, settings by start),
  a `torch.optim.Optimizer` whose
  `step()` is one LoGRA update with that optimizer's defaults for the toy here, built from a
  config (its `start="auto"` takes "scratch"; a model loaded with `from_pretrained` would get
  the paper's controller, uncalibrated): RowAdam's directions (rowadam.py;
  each layer's step scaled to its own weights, kl_control.py's departure 6), the KL probe on the
  last micro-batch's tokens and completion mask, alpha for the update's KL budget (its
  prediction calibrated by the realised KL of earlier updates, departure 5),
  the merge `W -= bf16(alpha U) A`, and the realised KL. `zero_grad()` does nothing (no weight has a
  gradient; the merge zeroes the sketches); its one param group has an `lr` that nothing reads,
  so that TRL's scheduler and logger find one (it logs learning_rate 0 and grad_norm 0).
- `compute_loss`, which records the micro-batch's ids, attention mask and completion mask for
  that probe, then returns TRL's own loss.
`max_grad_norm` must be 0 (there is no gradient to clip; the trainer refuses anything else), and
the model must be fp32 (RowAdam refuses bf16 master weights); `bf16=True` autocast is fine.
A Trainer checkpoint holds RowAdam's moments and update counter and, when it calibrates (the
toy here), the calibration (`LoGRAOptimizer.state_dict`), and a run resumed from one ends on the same weights, bit for bit
(tests/test_trl_example.py).
`--optimizer adamw` runs the same script with a plain `GRPOTrainer` and TRL's own AdamW
(TRL's defaults: fused AdamW, betas (0.9, 0.999), a linear decay, clipping at 1; a toy-sized lr)
on the same trainable weights, the attention/MLP projections, from the same initial weights,
prompts and seed.

TRL's GRPO loss is not the paper's (ppo.py), and LoGRA does not mind: the sketch accumulates
`S = G A^T` for whatever loss's backward reaches the target layers, and RowAdam's direction
does not depend on the loss's scale within an update (rowadam.py). What TRL does differently,
with its defaults (GRPOConfig):
1. Groups: `num_generations` (8 by default, at least 2) completions per prompt, where the paper
   samples one response per prompt.
2. The advantage is normalised per group, `(r - mean_group) / (std_group + 1e-4)`
   (`scale_rewards="group"`), where the paper's is `r - b` against a running baseline shared by
   the whole batch, without any std.
3. The loss sums the clipped token terms over the completion tokens and divides by the number
   of completion tokens of the whole accumulated batch (`loss_type="dapo"`): the paper's mean
   per token, over the global batch. `loss_type="grpo"` would average per sequence first.
4. With vLLM, TRL corrects the engine/trainer mismatch with its own importance weights
   (`vllm_importance_sampling_mode="sequence_mask"`, cap 3), where the paper truncates per-token
   weights at 2 (TIS). With one optimizer step per batch (`num_iterations=1`) the PPO ratio is 1
   in both and the clip never binds. Neither adds a KL penalty to a reference (`beta=0`).

The toy, on a CPU in well under a second a step: a 2-layer Qwen2 built from a config (fp32,
random weights at std 0.2 as examples/minimal_loop.py's; 29 tokens: a character-level
tokenizer made here, nothing downloaded), 64 prompts of 4 random letters made in memory, 8
completions of 8 letters per prompt at temperature 1, and the reward is the share of the 8
completion letters that are "a" (chance: 1/29). TRL generates with the model itself
(`use_vllm=False`). It prints each step's reward, LoGRA's alpha and KLs, and at the end the
median time of each optimizer's `optimizer.step()`, measured by a callback around TRL's own
call: LoGRA's step is the two forward passes of the probe and the realised KL plus the merge,
AdamW's an elementwise update; what LoGRA saves is the gradient, the two moments and the
activations its backward keeps (README.md; bench/update_cost.py measures updates side by side).

On GPUs, with TRL's vLLM in colocate mode, change these lines (and launch with
`accelerate launch --num_processes N examples/trl_grpo.py`):

    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)  # make_trainer(): fp32 masters
    tokenizer = AutoTokenizer.from_pretrained(PATH, padding_side="left")      # and a real dataset and reward
    GRPOConfig(..., use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
               bf16=True, use_cpu=False, gradient_checkpointing=True)        # config(): TRL's defaults again
    LoGRAGRPOTrainer(..., rank=256, update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5)  # Table 1's LoGRA settings

vLLM's engine loads the checkpoint from `model.name_or_path`, so the model must come from a
folder, not from a config as here. Several processes need no DDP: no weight requires grad, so
accelerate does not wrap the model, and `LoGRAOptimizer.step` sums the processes' sketches
itself (`RowAdam.prepare(group)`, one all_reduce per layer, the paper's). DeepSpeed and FSDP
are not supported here (train.py row-shards the sketches under FSDP2). Gradient checkpointing
and bf16 autocast ran on the CPU toy; nothing here has run on a GPU or in several processes.

What TRL lacks for LoGRA's weight sync: TRL pushes every full weight to its vLLM after each step
(`VLLMGeneration.sync_weights`: `load_weights` per parameter in colocate mode, a packed NCCL
broadcast of every parameter in server mode). LoGRA's seed-based sync sends only the bf16 factors
F (d, r) and the update number and needs the merge `W -= F A_t` on the engine side, into an
fp32 master kept as bf16 weight plus int16 residual (sync.py's `EngineWeights`;
infra/vllm_serve.py runs it as a vLLM worker extension). TRL gives no place for it: colocate
mode builds its `LLM` without a worker extension and server mode's `trl vllm-serve` has no
command for it. So under TRL, LoGRA merges into the trainer's fp32 weights and TRL sends them
whole, as train.py's `--sync full` control does: the same updates, the engine's bf16 weights
rounded from the same masters, only the payload is full-size. `LoGRAOptimizer.factors` holds
each step's F, what a sync would send. Nor is kl_control.py's mismatch subtraction applied:
TRL's batch carries vLLM's log-probs (`sampling_per_token_logps`), but here only TRL's own
importance weights use them, in the loss.

The LoGRA settings of the toy: the method files' defaults, nothing tuned (rank 32 by
sketch.default_rank, RowAdam's update_ratio, the probe's share of the batch and
kl_control.budget_for's budget); AdamW's lr is 3e-3, minimal_loop.py's best.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the toy downloads nothing; read before huggingface_hub loads
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainers ping the Hub when they start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the method files, flat

from infra import one_call  # noqa: E402
from infra.probe_decoder import fast_probe  # noqa: E402
import sketch  # noqa: E402
from infra.batched import BatchedRowAdam  # noqa: E402  rowadam.RowAdam over stacks of layers: its bits

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = ["<pad>", "<eos>", "<unk>"]
GOOD, PROMPT, COMPLETION = "a", 4, 8


# -----------------------------------------------------------------------------
# LoGRA as the Trainer's optimizer

class LoGRAGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with LoGRA as its optimizer (infra/one_call.py's LoGRAOptimizer): `rank` of the
    sketches, `seed` of their projections, `update_ratio` (RowAdam), and the KL budget: the
    method's default (kl_control.budget_for), or `kl_start` -> `kl_end` nats per completion
    token, cosine over the run's steps. Every setting left out is the method files' default.
    The model must hold fp32 weights, and `args.max_grad_norm` must be 0.

        trainer = LoGRAGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(..., max_grad_norm=0.0),
                                   train_dataset=dataset, processing_class=tokenizer)
        trainer.train()                              # every optimizer step one LoGRA update
    """

    def __init__(self, *args, rank=None, seed=0, update_ratio=None, kl_start=None, kl_end=None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.args.max_grad_norm}: set it to 0 for LoGRA, which forms no "
                             f"gradient to clip (its step is bounded by the KL budget)")
        if (kl_start is None) != (kl_end is None):
            raise ValueError("kl_start and kl_end go together (the schedule's two ends), or neither (the default "
                             "budget)")
        self.logra_settings = dict(rank=rank, seed=seed, update_ratio=update_ratio, kl_start=kl_start, kl_end=kl_end)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            model = self.model if model is None else model
            s = self.logra_settings
            layers = sketch.attach(model, s["rank"], s["seed"])  # S and A_0 on every target; all frozen
            schedule = {} if s["kl_start"] is None else dict(kl_start=s["kl_start"], kl_end=s["kl_end"],
                                                             horizon=self.state.max_steps)  # the run's steps
            settings = {} if s["update_ratio"] is None else {"update_ratio": s["update_ratio"]}
            self.logra = one_call.LoGRAOptimizer(
                model, BatchedRowAdam(layers, **settings), temperature=self.temperature,
                keep_positions=512, group=dist.group.WORLD if self.accelerator.num_processes > 1 else None,
                log=lambda name, value: self._metrics["train"][name].append(value), probe=fast_probe, **schedule)
            self.optimizer = self.logra  # accelerate wraps it next; self.logra stays ours
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The tokens and masks of this micro-batch, for the probe in the step after its backward:
        # prompts are left-padded (attention mask), the response is the completion, up to its EOS.
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (B, T)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, T)
        response_mask = torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1).bool()  # (B, T)
        self.logra.batch = (ids, attention_mask, response_mask)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


# -----------------------------------------------------------------------------
# The toy: tokenizer, model, prompts, reward

def make_tokenizer():
    """A character-level tokenizer of the 26 letters and 3 special tokens, padding on the left (TRL's rule)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + list(LETTERS))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()  # and decoded without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def tiny_model(tokenizer, seed: int):
    """A 2-layer Qwen2 from a config: fp32 weights, random at std 0.2, the same for both optimizers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)  # Hugging Face initialises from the global generator
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         initializer_range=0.2, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return Qwen2ForCausalLM(config).to(torch.float32)


def prompts(count: int, seed: int):
    """`count` prompts of PROMPT random letters, in memory."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    letters = torch.randint(0, len(LETTERS), (count, PROMPT), generator=g)
    return Dataset.from_dict({"prompt": ["".join(LETTERS[i] for i in row) for row in letters.tolist()]})


def share_of_good(completions, **kwargs):
    """The reward: the share of the COMPLETION letters that are GOOD (an early EOS leaves fewer)."""
    return [c.count(GOOD) / COMPLETION for c in completions]


# -----------------------------------------------------------------------------
# One run of each optimizer

def config(method: str, *, steps: int, seed: int, output_dir: str, **overrides) -> GRPOConfig:
    """TRL's GRPO defaults, made small for a CPU: 8 prompts x 8 completions of 8 tokens per step."""
    return GRPOConfig(**{
        "output_dir": output_dir, "max_steps": steps, "seed": seed, "per_device_train_batch_size": 64,
        "num_generations": 8, "max_completion_length": COMPLETION, "temperature": 1.0, "use_vllm": False,
        "use_cpu": True, "bf16": False, "gradient_checkpointing": False, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "disable_tqdm": True,
        # LoGRA: no gradient to clip, and the lr nothing reads; AdamW: TRL's clip at 1 and a toy lr
        "max_grad_norm": 0.0 if method == "logra" else 1.0, "learning_rate": 0.0 if method == "logra" else 3e-3,
        **overrides})


def make_trainer(method: str, *, steps: int, seed: int, output_dir: str, callbacks=(), **overrides):
    """The toy's trainer for `method` ("logra" or "adamw") on a fresh model; `overrides`: GRPOConfig's."""
    from transformers.trainer_callback import PrinterCallback

    tokenizer = make_tokenizer()
    model = tiny_model(tokenizer, seed)
    common = dict(model=model, reward_funcs=share_of_good, processing_class=tokenizer, callbacks=list(callbacks),
                  args=config(method, steps=steps, seed=seed, output_dir=output_dir, **overrides),
                  train_dataset=prompts(64, seed))
    if method == "logra":
        trainer = LoGRAGRPOTrainer(**common, seed=seed)  # every LoGRA setting the method files' default
    else:
        targets = [m.weight for m in sketch.target_modules(model).values()]  # what LoGRA trains, no more
        for p in model.parameters():
            p.requires_grad_(any(p is t for t in targets))
        trainer = GRPOTrainer(**common)
    trainer.remove_callback(PrinterCallback)  # TRL's print of every log dict; StepLog prints one line
    return trainer


class StepLog(TrainerCallback):
    """The time of TRL's own `optimizer.step()` call, TRL's `step_time` (generation, loss and
    backward), and one printed line per step."""

    def __init__(self, method, log):
        self.method, self.log = method, log
        self.times, self.rewards, self.rest = [], [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "reward" not in logs:  # the end of training's summary
            return
        self.rewards.append(logs["reward"])
        self.rest.append(logs["step_time"])
        if self.method == "logra":
            info = (f"alpha {logs['logra/alpha']:.2f} | kl {logs['logra/kl_predicted']:.1e} "
                    f"(real {logs['logra/kl_realised']:.1e}) | budget {logs['logra/budget']:.1e}")
        else:
            info = f"lr {logs['learning_rate']:.1e} | grad norm {logs['grad_norm']:.2f}"
        self.log(f"{self.method:5s} step {state.global_step:3d} | reward {logs['reward']:.3f} | {info} | "
                 f"optimizer step {1e3 * self.times[-1]:.1f} ms")


def train(method: str, *, steps: int, seed: int, log=print) -> dict:
    """One run of `method` through TRL: its reward per step and optimizer-step times."""
    callback = StepLog(method, log)
    with tempfile.TemporaryDirectory() as output_dir:  # TRL wants one; save_strategy="no" writes nothing there
        trainer = make_trainer(method, steps=steps, seed=seed, output_dir=output_dir, callbacks=[callback])
        trainer.train()
    return {"rewards": callback.rewards, "times": callback.times, "rest": callback.rest, "model": trainer.model,
            "trainer": trainer}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--optimizer", choices=("logra", "adamw", "both"), default="both")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small matmuls: threads only add overhead, and the timing is steadier
    methods = ("logra", "adamw") if args.optimizer == "both" else (args.optimizer,)
    runs = {m: train(m, steps=args.steps, seed=args.seed) for m in methods}
    for method, run in runs.items():
        first, last = run["rewards"][:5], run["rewards"][-5:]
        print(f"{method}: reward {statistics.mean(first):.3f} (first 5) -> {statistics.mean(last):.3f} (last 5); "
              f"optimizer step {1e3 * statistics.median(run['times']):.1f} ms, the rest of TRL's step "
              f"{1e3 * statistics.median(run['rest']):.0f} ms (medians)")
    if len(runs) == 2:
        ratio = statistics.median(runs["logra"]["times"]) / statistics.median(runs["adamw"]["times"])
        print(f"LoGRA's optimizer step takes {ratio:.0f}x AdamW's on this toy (medians): its probe and realised "
              f"KL are two forward passes, AdamW's step an elementwise update")
    return runs


if __name__ == "__main__":
    main()

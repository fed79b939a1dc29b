"""
infra/engine.py: the rollout interface, and its reference engine in this process.

What it is
----------
A rollout engine is a bf16 copy of the policy that samples responses and changes only through
the payloads of sync.py (the paper's method section on seed-based sync, arXiv:2610.06647: the
engines receive the low-rank factor and the seed instead of full weights). Every engine has
the same five methods:

    generate(prompts, seeds, *, temperature, max_new_tokens, top_p) -> Rollout
    apply(payload) -> bytes      merge one delta payload (sync.Payload: factors + seed, or sparse)
    load_full(payload) -> bytes  replace target weights (sync.full_payload)
    fingerprint() -> dict        what it holds, for sync.check_fingerprints
    close(), take_events()       stop it; the restarts since the last call (heal.py)

Whatever the engine, `rollout_slots` says which prompt and seed each response of an update
gets (a prompt's G responses on one rank), and `evaluate` samples the held-out problems
through it for Pass@1 and Pass@k.

`HFEngine` is that interface over a Hugging Face model in this process (the tiny preset on a
CPU, the GPU smoke run), and reads whole here. vLLM engine processes are vllm_serve.py, the
trainer's handle on one and its supervision vllm_engine.py, their weight channel
vllm_channel.py; heal.py restarts an engine that dies.

Shape legend: B batch (prompts), P prompt tokens, T prompt + response tokens, V vocab.

Departures from the paper
-------------------------
1. `HFEngine` samples with Gumbel-max noise drawn per response from a generator seeded by
   (run seed, update, global response index: `rollout_slots`): rollouts do not
   depend on how prompts are split across trainer processes, the G responses of a prompt
   (--group-size) differ, and a resumed run samples what the uninterrupted run sampled (the paper
   samples with vLLM's own seeds). Tests: tests/test_engine.py,
   test_each_prompt_draws_from_its_own_seed; tests/test_train.py,
   test_one_and_two_processes_agree.

Implementation notes
--------------------
- `HFEngine` generates with a KV cache where `kv_cache` (train.py: on GPUs), else by running
  the whole sequence again for every new token: the tiny presets' CPU rows were made that way
  (bench/README.md's tables), and at their size it is as fast. Both draw the same noise; their
  logits differ by the rounding of other kernels' sums (tests/test_engine.py: the same tokens
  and log-probs within 1e-5 in fp32).
- With --gpus 1 (infra/one_gpu.py) the engine keeps no master at all (`exact=False`) and its
  bf16 weights are cast from the trainer's after every merge.
"""

import hashlib
import math

import torch

from infra import metrics, wire
from infra.checksum import checksums
from infra.engine_weights import StreamedEngineWeights
from infra.sparse_delta import SparseEngineWeights
from infra.errors import RunError


def rollout_slots(update: int, *, batch: int, group_size: int, seed: int, world: int, rank: int):
    """This rank's part of an update's rollout: (the index of each response's prompt in the
    task's training stream, its sampling seed). Response j of the update (all ranks together,
    rank-major) answers prompt j // G of the update's batch / G prompts, so a prompt's G
    responses are consecutive rows of one rank (options.Config.check: whole groups per rank), and
    every response has its own seed, from its global index: the same on 1 or N ranks, and on
    resume. G = 1 is the paper's one response per prompt."""
    per_rank = batch // world
    first = update * batch + rank * per_rank  # global index of this rank's first response
    prompts = [(first + i) // group_size for i in range(per_rank)]
    seeds = [stable_seed("rollout", seed, update, first + i) for i in range(per_rank)]
    return prompts, seeds


SHOWN = 8  # responses an evaluation returns as text (`eval_texts`), for a reader to check its grades


def evaluate(engine, task, *, samples, temperature, top_p, max_new_tokens, seed, world, rank,
             device, problems=None) -> dict:
    """Held-out {pass1, passk, pass1_se, eval_problems, eval_samples, eval_tokens_mean,
    eval_texts}, k = `samples`: Pass@1 is the mean score of the k samples of a problem (1
    right, 0 wrong; Reasoning Gym's in [0, 1]), Pass@k their best, pass1_se Pass@1's standard
    error over problems (the sd of the problems' mean scores / sqrt(problems): the error of a
    mean over these problems' draws), eval_tokens_mean the generated tokens a response (as the
    engine returned them, EOS included), eval_texts the first sample of this rank's first
    `SHOWN` problems as {question, response, score}. `problems`: the first n of `task.heldout`
    (None: all). Sums and counts over ranks: rank `rank` of `world` samples every world-th
    problem, each sample with a seed from (run seed, problem, sample), so any number of ranks
    scores the same samples."""
    heldout = task.heldout[:problems]
    problems = heldout[rank::world]
    right = torch.zeros(len(problems), samples)
    tokens, texts = 0, []
    bar = metrics.Progress(samples * len(heldout), "evaluation: samples", enabled=rank == 0)
    for s in range(samples):
        seeds = [stable_seed("eval", seed, i * world + rank, s) for i in range(len(problems))]
        rollout = engine.generate(task.prompt_ids(problems), seeds, temperature=temperature, top_p=top_p,
                                  max_new_tokens=max_new_tokens)
        right[:, s] = torch.tensor([task.correct(p, y) for p, y in zip(problems, rollout.responses)],
                                   dtype=torch.float32)
        tokens += sum(map(len, rollout.responses))
        if s == 0:
            texts = [{"question": task.question(p), "response": task.decode(y), "score": float(right[i, 0])}
                     for i, (p, y) in enumerate(zip(problems[:SHOWN], rollout.responses))]
        bar.update(len(heldout))
    bar.close()
    means = right.mean(1).double()
    (correct, any_correct, n_samples, count, squares, tokens), _ = metrics.global_sums(
        [right.sum().item(), right.amax(1).sum().item(), right.numel(), len(problems), means.square().sum().item(),
         tokens], device=device)
    pass1 = correct / n_samples
    variance = max(squares / count - pass1**2, 0.0) * count / max(count - 1, 1)  # of a problem's mean score
    return {"pass1": pass1, "passk": any_correct / count, "pass1_se": math.sqrt(variance / count),
            "eval_problems": int(count), "eval_samples": samples, "eval_tokens_mean": tokens / n_samples,
            "eval_texts": texts}


def stable_seed(*parts) -> int:
    """A 63-bit seed from its parts (run seed, update, global index...): the same on every rank."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


class Rollout:
    """Right-padded prompt + response ids (B, T), response mask (B, T), the sampler's log-probs
    of the generated tokens (B, T), whether each response ended with EOS (B,), and the
    response token ids per sample (for grading)."""

    def __init__(self, ids, mask, logprobs, eos, responses):
        self.ids, self.mask, self.logprobs, self.eos, self.responses = ids, mask, logprobs, eos, responses

    def padded(self, length: int, pad: int) -> "Rollout":
        """The same rollout right-padded to `length` tokens (ids `pad`, mask False, log-prob 0).
        A padded position is outside every response, and under causal attention it changes
        no earlier position: only the tensors' shape changes."""
        extra = length - self.ids.shape[1]
        if extra < 0:
            raise ValueError(f"a rollout of {self.ids.shape[1]} tokens cannot be padded to {length}")
        if extra == 0:
            return self
        right = (0, extra)
        return Rollout(torch.nn.functional.pad(self.ids, right, value=pad),
                       torch.nn.functional.pad(self.mask, right, value=False),
                       torch.nn.functional.pad(self.logprobs, right, value=0.0), self.eos, self.responses)


class EngineError(RunError, RuntimeError):
    """An engine process died, stayed silent past its timeout, or failed a command (exit 1)."""

    exit_code = 1
    label = "engine error"


class EngineLost(EngineError):
    """The engine process exited, closed its connection, or gave no answer within its timeout:
    a fault that a new engine heals (heal.py), unlike a command the engine answered with an
    error (a bad payload, a model vLLM refuses), which a restart would only repeat."""


# -----------------------------------------------------------------------------
# The Hugging Face engine: in this process

class HFEngine:
    """A Hugging Face model in bf16, merged by sync payloads (the tiny preset, the GPU smoke run).

    `sketch_rank` is the rank r of the payloads' factors; `base_seed` the run's seed, from
    which every projection A is regenerated (sync.py). `exact`: keep the trainer's fp32 master
    (bf16 + an int16 residual) to merge factors; False for sparse deltas, full syncs and casts
    only. `kv_cache`: generate with one (the implementation notes).
    """

    def __init__(self, model, *, base_seed, sketch_rank, eos, pad, exact=True, kv_cache=False):
        self.model = model.eval()
        kind = StreamedEngineWeights if exact else SparseEngineWeights  # a master to merge factors, or none
        self.weights = kind(model, base_seed=base_seed, rank=sketch_rank, checksums=checksums)
        self.eos, self.pad, self.kv_cache = eos, pad, kv_cache

    @torch.no_grad()
    def generate(self, prompts, seeds, *, temperature, max_new_tokens, top_p=1.0) -> Rollout:
        """Sample one response per prompt; per-token log-probs as the sampler saw them."""
        device = next(self.model.parameters()).device
        prompts = torch.tensor(prompts)  # (B, P): the tiny task's prompts all have one length
        b, p = prompts.shape
        vocab = self.model.config.vocab_size
        # Gumbel-max with noise drawn per prompt from its own generator (departure 1).
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        ids = prompts.to(device)
        logprobs = torch.zeros(b, p + max_new_tokens, device=device)
        ended = torch.zeros(b, dtype=torch.bool, device=device)
        cache = None
        for t in range(max_new_tokens):
            if self.kv_cache:  # the prompts once, then one new token a step (the prompts share one length)
                out = self.model(input_ids=ids if cache is None else ids[:, -1:], past_key_values=cache, use_cache=True,
                                 logits_to_keep=1)
                cache = out.past_key_values
            else:  # the whole sequence again (implementation notes)
                out = self.model(input_ids=ids)
            logits = out.logits[:, -1].float() / temperature  # (B, V)
            if top_p < 1.0:
                logits = top_p_filter(logits, top_p)
            noise = torch.stack([torch.rand(vocab, generator=g, device=device) for g in gens])  # (B, V)
            gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
            token = torch.argmax(logits + gumbel, dim=-1)  # (B,)
            logp = torch.log_softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1)  # (B,)
            token = torch.where(ended, self.pad, token)
            logprobs[:, p + t] = torch.where(ended, 0.0, logp)
            ids = torch.cat([ids, token[:, None]], dim=1)  # (B, P + t + 1)
            ended |= token == self.eos
            if ended.all():
                break
        length = ids.shape[1]
        mask = torch.zeros(b, length, dtype=torch.bool, device=device)
        mask[:, p:] = ids[:, p:] != self.pad  # generated tokens, EOS included
        responses = [[i for i in row if i != self.pad] for row in ids[:, p:].tolist()]
        return Rollout(ids, mask, logprobs[:, :length], ended, responses)

    def apply(self, payload) -> int:
        """Merge one payload, through the wire format; returns the bytes it took."""
        buf = wire.encode(payload)
        self.weights.apply(wire.decode(buf))
        return buf.numel()

    def load_full(self, payload) -> int:
        buf = wire.encode(payload)
        self.weights.load_full(wire.decode(buf))
        return buf.numel()

    def fingerprint(self):
        return self.weights.fingerprint()

    def close(self):
        pass  # nothing to stop: the model lives in this process

    def take_events(self) -> list:
        return []  # nothing to restart either (heal.py supervises engine processes)


def top_p_filter(logits, top_p):
    """Keep the smallest set of tokens whose probability reaches top_p; others get -inf."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
    probs = torch.softmax(sorted_logits, -1)
    drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token is already enough
    sorted_logits[drop] = float("-inf")
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)

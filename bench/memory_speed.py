"""One training step, side by side: dense AdamW, LoRA, GaLore, APOLLO and LoGRA.

The same Qwen2-architecture model of about 100M parameters (hidden 768, 8 layers,
intermediate 2048, vocab 32000, built from a config), the same RL loss (ppo.policy_loss on
the same batch of 4 x 256 tokens, the last 192 of each a "response"), the same seven target
projections trained at the same rank r = 256 by every method; everything else frozen.

Memory: torch's MemTracker (it works on the CPU) splits the peak of one step into
parameters, gradients, optimizer state and activations (+ temporaries). LoGRA's sketches,
projections and row moments live outside modules and optimizers, where MemTracker does not
look, so they are counted from their tensors and added as its optimizer state.
Time: median of interleaved repetitions of the whole step (forward, backward, optimizer).
Peers that do not install or run are reported with the reason. They are the `bench` extra.

    python bench/memory_speed.py [--reps 5] [--rank 256] [--markdown]
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kl_control  # noqa: E402
from infra.probe_decoder import fast_probe  # noqa: E402
import ppo  # noqa: E402
from infra import metrics  # noqa: E402
import report  # noqa: E402  (bench/report.py)
from infra.batched import BatchedRowAdam  # noqa: E402
import sketch  # noqa: E402

MIB = 2**20


def build():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (4, 256), generator=g)  # (B, T)
    mask = torch.zeros(4, 256, dtype=torch.bool)
    mask[:, 64:] = True
    adv = torch.randn(4, generator=g)
    return ids, mask, adv


def loss_of(model, ids, mask, adv):
    logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
    loss, _ = ppo.policy_loss(logp, adv, mask, rollout_logprobs=logp.detach(), num_tokens=int(mask.sum()))
    return loss


def targets_of(model):
    return [m.weight for m in sketch.target_modules(model).values()]


def freeze_but_targets(model):
    for p in model.parameters():
        p.requires_grad_(False)
    for w in targets_of(model):
        w.requires_grad_(True)


# Each setup returns (model, optimizer or None, step function, extra bytes MemTracker cannot see).

def optimizer_step(model, opt):
    """One step of a torch-style optimizer: loss, backward, step, gradients freed."""
    def step(ids, mask, adv):
        loss_of(model, ids, mask, adv).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def dense_adamw(base, rank):
    model = copy.deepcopy(base)
    freeze_but_targets(model)
    opt = torch.optim.AdamW(targets_of(model), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
    return model, opt, optimizer_step(model, opt), 0


def lora(base, rank):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                                                           target_modules=list(sketch.TARGETS)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.0)
    return model, opt, optimizer_step(model, opt), 0


def galore(base, rank):
    from galore_torch import GaLoreAdamW

    model = copy.deepcopy(base)
    freeze_but_targets(model)
    opt = GaLoreAdamW([{"params": targets_of(model), "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                        "proj_type": "std"}], lr=1e-6, weight_decay=0.0)
    return model, opt, optimizer_step(model, opt), 0


def apollo(base, rank):
    from apollo_torch import APOLLOAdamW

    model = copy.deepcopy(base)
    freeze_but_targets(model)
    opt = APOLLOAdamW([{"params": targets_of(model), "rank": rank, "proj": "random", "scale_type": "channel",
                        "scale": 1, "update_proj_gap": 200, "proj_type": "std"}], lr=1e-6, weight_decay=0.0)
    return model, opt, optimizer_step(model, opt), 0


LOGRA_PHASES = {"backward": [], "prepare": [], "probe": [], "merge": []}


def logra(base, rank):
    model = copy.deepcopy(base)
    layers = sketch.attach(model, rank=rank, seed=0)
    opt = BatchedRowAdam(layers, seed=0)

    def step(ids, mask, adv, probe=True):
        # The whole update as train.py runs it: backward into the sketches, RowAdam, the KL
        # probe on the first 2 responses (as the paper), merge at the alpha it gives.
        t0 = time.perf_counter()
        loss_of(model, ids, mask, adv).backward()
        t1 = time.perf_counter()
        opt.prepare()
        t2 = time.perf_counter()
        kl1 = fast_probe(model, layers, opt.directions, ids, mask, max_responses=2).kl1 if probe else 0.0
        t3 = time.perf_counter()
        opt.merge(kl_control.solve_alpha(kl1, budget=2e-4))
        t4 = time.perf_counter()
        if probe:
            for name, dt in zip(LOGRA_PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                LOGRA_PHASES[name].append(dt)
    state = sum(t.numel() * t.element_size() for l in layers for t in (l.sketch, l.signs)) \
        + sum(v.numel() * v.element_size() for v in opt.moments) + sum(u.numel() * u.element_size() for u in opt._u)
    return model, None, step, state


METHODS = {"dense AdamW": dense_adamw, "LoRA + AdamW (peft)": lora, "GaLore AdamW": galore,
           "APOLLO": apollo, "LoGRA": logra}


class _NoHook:
    def remove(self):
        pass


def measure_memory(setup, base, rank, data):
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt, step, extra = setup(base, rank)
    step(*data)  # optimizer states exist from here on, as in a running job
    tracker = MemTracker()
    # MemTracker hooks every parameter's gradient and fails on frozen ones (all methods here
    # freeze most of the model): mark those as already hooked. (A private field of torch 2.13.)
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(*(x for x in (model, opt) if x is not None))
    with tracker:
        # MemTracker cannot follow a module called twice in one step, so LoGRA's memory step
        # leaves the KL probe out; the probe runs after backward, when the activations are gone.
        step(*data, probe=False) if setup is logra else step(*data)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {"params": peak.get("Parameter", 0) + peak.get("Buffer", 0), "grads": peak.get("Gradient", 0),
            "optimizer": peak.get("Optstate", 0) + extra,
            "activations": peak.get("Activation", 0) + peak.get("Temp", 0) + peak.get("Other", 0),
            "total": peak.get("Total", 0) + extra}, (model, step)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "memory_speed.png"))
    args = report.parse_args(p, "memory_speed")
    base, data = build(), batch()
    mem, steps, failed = {}, {}, {}
    for name, setup in METHODS.items():
        try:
            mem[name], (_, steps[name]) = measure_memory(setup, base, args.rank, data)
        except Exception as e:  # a peer that does not install or run here
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    times = {name: [] for name in steps}
    for rep in range(args.reps + 1):  # interleaved; the first round warms up
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(*data)
            if rep:
                times[name].append(time.perf_counter() - t0)

    n_params = sum(p.numel() for p in base.parameters())
    caption = (f"Qwen2 {n_params / 1e6:.0f}M parameters, batch 4 x 256 tokens, rank {args.rank}, fp32 on this CPU "
               f"({torch.get_num_threads()} threads), time = median of {args.reps}")
    header = ["method", "params", "grads", "optimizer state", "activations + temp", "peak", "p+g+o vs AdamW",
              "peak vs AdamW", "step time", "vs AdamW"]
    rows = []
    ref = mem["dense AdamW"]
    ref_pgo = ref["params"] + ref["grads"] + ref["optimizer"]
    ref_t = statistics.median(times["dense AdamW"])
    for name, m in mem.items():
        t = statistics.median(times[name])
        pgo = m["params"] + m["grads"] + m["optimizer"]
        rows.append([name, f"{m['params'] / MIB:.0f} MiB", f"{m['grads'] / MIB:.0f} MiB",
                     f"{m['optimizer'] / MIB:.0f} MiB", f"{m['activations'] / MIB:.0f} MiB",
                     f"{m['total'] / MIB:.0f} MiB", f"{pgo / ref_pgo:.2f}x", f"{m['total'] / ref['total']:.2f}x",
                     f"{t * 1e3:.0f} ms", f"{t / ref_t:.2f}x"])
    for name, why in failed.items():
        rows.append([name, f"not measured: {why}"])
    result = [caption, report.table(header, rows)]  # the paragraphs of the Markdown block
    print("\n".join(result))
    if LOGRA_PHASES["probe"]:
        med = {k: statistics.median(v[1:] or v) * 1e3 for k, v in LOGRA_PHASES.items()}  # after the warm-up
        result.append("LoGRA's update by phase (median ms): " + ", ".join(f"{k} {v:.0f}" for k, v in med.items())
                      + f"; the KL probe is {med['probe'] / sum(med.values()):.0%} of it")
        print("\n" + result[-1])

    # The physical limit of LoGRA's state: fp32 weights + sketches S and directions U (fp32)
    # + the int8 signs of A + row moments.
    shapes = [w.shape for w in targets_of(base)]
    limit = 4 * n_params + sum(8 * d * args.rank + args.rank * k + 4 * d for d, k in shapes)
    if "LoGRA" in mem:
        lo = mem["LoGRA"]
        result.append(f"LoGRA, smallest state it could hold (fp32 weights + S + U + int8 signs of A + row moments, "
                      f"from shapes): {limit / MIB:.0f} MiB; measured params + grads + optimizer state: "
                      f"{(lo['params'] + lo['grads'] + lo['optimizer']) / MIB:.0f} MiB")
        print("\n" + result[-1])
    plot(mem, args.png)
    if args.markdown:
        report.publish("memory_speed", "\n\n".join(result))


def plot(mem, path):
    plt = metrics.pyplot()
    if plt is None:
        print("no chart: pip install matplotlib")
        return
    names = list(mem)
    bottom = [0.0] * len(names)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for part in ("params", "grads", "optimizer", "activations"):
        vals = [mem[n][part] / MIB for n in names]
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB at the step's peak")
    ax.legend()
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()

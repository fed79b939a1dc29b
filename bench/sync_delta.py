"""How much of the bf16 target weights one update changes, and what an exact sparse delta of those
changes would weigh beside LoGRA's factor sync and the full bf16 sync; measured on real updates.

A sparse delta sends, for every target weight, the positions and new bf16 values of the elements
whose bf16 cast changed in the update: lossless, and the engine needs no fp32 master. Its size
here, per target layer, is 2 bytes a changed value plus the smaller of two index encodings:

    bitmap   one bit per element of the weight: d k / 8 bytes
    gaps     the distance from each changed position to the previous one (row-major, the first
             from -1), each an unsigned LEB128 varint: 1 byte below 128, 2 below 16384, ...

(and a 16-byte header a layer, as a stand-in for names and shapes). Measured:

1. The tiny preset, `python train.py --optimizer M --save-every 1` for LoGRA, AdamW and LoRA (its
   merged weights W + (alpha / r) B A, which the engines run): consecutive checkpoints'
   master weights cast to bf16, over the whole run. Factor and full bytes are the runs' own
   `sync_bytes` (LoGRA's factors with their header; AdamW's and LoRA's full bf16 weights).
2. SmolLM2-135M-Instruct (bench/real_model.py's checkpoint: `--checkpoint DIR`), LoGRA and AdamW
   at the paper's settings (update_ratio 6e-5 with its budget 2e-4 per token, alpha <= 3;
   AdamW lr 1e-6, betas (0.9, 0.95)), a few REINFORCE updates of examples/minimal_loop.py's
   kind on the model's own samples (reward: the share of digits in a 24-token answer to an
   arithmetic question), rank 64: the share changed per update and the three payloads.
3. The paper's 7B and 27B (r = 256, their target shapes from the presets): each payload
   projected from the changed share measured in 2, assuming it holds at that size (the share
   is set by the step relative to bf16's spacing, which the paper's settings fix per weight,
   not per model); the gap code's bytes for positions drawn independently at that share.

    python bench/sync_delta.py --checkpoint DIR [--out runs/sync-delta] [--markdown]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
import report  # noqa: E402  (bench/report.py)

LAYER_HEADER = 16


def varint_bytes(values: torch.Tensor) -> int:
    """Total bytes of unsigned LEB128 varints of `values` (int64 >= 0)."""
    total, v = 0, values.clone()
    while v.numel():
        total += v.numel()  # every value still > 0 after k shifts takes a k-th byte
        v = v[v >= 128] >> 7
    return int(total)


def delta_bytes(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    """(changed elements, exact sparse delta bytes) from bf16 `before` to bf16 `after` of one weight."""
    changed = (before.view(torch.int16) != after.view(torch.int16)).reshape(-1)
    positions = changed.nonzero().squeeze(1)  # row-major
    n = positions.numel()
    if n == 0:
        return 0, LAYER_HEADER
    gaps = torch.diff(positions, prepend=torch.tensor([-1])) - 1  # >= 0
    index = min(math.ceil(changed.numel() / 8), varint_bytes(gaps))
    return n, LAYER_HEADER + index + 2 * n


def expected_gap_bytes(share: float) -> float:
    """Mean LEB128 bytes of one gap when each element changes independently with probability
    `share` (gaps geometric): sum over byte counts b of P(gap >= 128^(b-1))."""
    return 1 + sum((1 - share) ** (128 ** b) for b in range(1, 9))


def targets_of(state: dict, method: str, lora_scaling: float) -> dict:
    """{name: fp32 weight the engine runs} of every target in a checkpoint's model state; for
    LoRA W + scaling B A (scaling = lora_alpha / r, as infra/lora.py's merged_weight)."""
    import sketch

    out = {}
    if method == "lora":
        for key, a in state.items():
            if key.endswith(".lora_A.default.weight"):
                base = key[:-len(".lora_A.default.weight")]
                b = state[base + ".lora_B.default.weight"]
                w = state[base + ".base_layer.weight"]
                out[base] = torch.addmm(w.float(), b.float(), a.float(), alpha=lora_scaling)
        return out
    return {k: v.float() for k, v in state.items() if k.endswith(".weight") and k.split(".")[-2] in sketch.TARGETS}


def tiny_runs(out: str) -> list[list]:
    """Part 1: one tiny-preset run per optimizer with a checkpoint every update."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    rows = []
    for method in ("logra", "adam", "lora"):
        run_dir = os.path.join(out, f"tiny-{method}")
        if not os.path.exists(os.path.join(run_dir, "latest")) or \
                open(os.path.join(run_dir, "latest")).read().strip() != "checkpoint-150":
            subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--optimizer", method, "--save-every", "1",
                            "--keep", "1000", "--eval-every", "0", "--run-dir", run_dir], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
        metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        config = json.load(open(os.path.join(run_dir, "config.json")))
        scaling = config["lora_alpha"] / config["sketch_rank"]  # LoRA's rank is the sketch rank (--rank)
        sync_bytes = [r["sync_bytes"] for r in metrics if "sync_bytes" in r]
        shares, deltas, previous = [], [], None
        for n in range(1, 151):
            path = os.path.join(run_dir, f"checkpoint-{n}")
            flat = path + ".pt"
            dcp_to_torch_save(path, flat)
            state = torch.load(flat, weights_only=False)["model"]
            os.remove(flat)
            now = {k: v.to(torch.bfloat16) for k, v in targets_of(state, method, scaling).items()}
            if previous is not None:
                changed = total = size = 0
                for k, w in now.items():
                    c, b = delta_bytes(previous[k], w)
                    changed, total, size = changed + c, total + w.numel(), size + b
                shares.append(changed / total)
                deltas.append(size)
            previous = now
        full = sum(w.numel() for w in previous.values()) * 2
        rows.append(["tiny", method, f"{100 * statistics.median(shares):.2f}% ({100 * min(shares):.2f}..{100 * max(shares):.2f})",
                     f"{statistics.median(sync_bytes) / 1e3:.1f} KB" if method == "logra" else "",
                     f"{statistics.median(deltas) / 1e3:.1f} KB", f"{full / 1e3:.1f} KB",
                     f"{statistics.median(deltas) / full:.3f}"])
        print(report.row(rows[-1]), flush=True)
    return rows


def real_model(checkpoint: str, updates: int, rank: int = 64) -> tuple[list[list], dict]:
    """Part 2: LoGRA and AdamW at the paper's settings on SmolLM2-135M, a few updates each."""
    import kl_control
    import ppo
    import sketch
    from rowadam import RowAdam
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.padding_side = "left"
    questions = [f"What is {a} + {b}? Answer with the number." for a, b in
                 ((17, 25), (38, 46), (123, 77), (59, 64), (8, 91), (240, 135), (66, 66), (14, 39))]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    rows, shares = [], {}
    for method in ("logra", "adam"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        targets = sketch.target_modules(model)
        if method == "logra":
            layers = sketch.attach(model, rank=rank, seed=0)
            opt = RowAdam(layers, update_ratio=6e-5)
        else:
            weights = [m.weight for m in targets.values()]
            for p_ in model.parameters():
                p_.requires_grad_(any(p_ is w for w in weights))
            opt = torch.optim.AdamW(weights, lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        changed_shares, deltas, factors, alphas = [], [], [], []
        full = sum(m.weight.numel() for m in targets.values()) * 2
        for update in range(updates):
            with torch.no_grad():
                out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=24,
                                     pad_token_id=tok.pad_token_id)
            ids = out
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[:, enc.input_ids.shape[1]:] = ids[:, enc.input_ids.shape[1]:] != tok.pad_token_id
            attention = (ids != tok.pad_token_id) | mask
            texts = tok.batch_decode(ids[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
            reward = torch.tensor([sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts])
            advantages = reward - reward.mean()
            logits = model(input_ids=ids, attention_mask=attention).logits
            loss, _ = ppo.policy_loss(ppo.response_logprobs(logits, ids), advantages, mask,
                                      num_tokens=int(mask.sum()))
            loss.backward()
            before = {n: m.weight.detach().to(torch.bfloat16) for n, m in targets.items()}
            if method == "logra":
                opt.prepare()
                probe = kl_control.probe(model, layers, opt.directions, ids, mask, attention_mask=attention)
                alpha = kl_control.solve_alpha(probe.kl1, budget=kl_control.kl_budget(update))
                merged = opt.merge(alpha)
                factors.append(sum(f.numel() * f.element_size() for f in merged))
                alphas.append(alpha)
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            changed = size = 0
            for n, m in targets.items():
                c, b = delta_bytes(before[n], m.weight.detach().to(torch.bfloat16))
                changed, size = changed + c, size + b
            changed_shares.append(changed / (full / 2))
            deltas.append(size)
            print(f"  {method} update {update}: changed {100 * changed_shares[-1]:.3f}%, delta {size / 1e6:.2f} MB"
                  + (f", alpha {alphas[-1]:.2f}" if alphas else ""), flush=True)
        shares[method] = statistics.median(changed_shares)
        rows.append(["SmolLM2-135M", method, f"{100 * shares[method]:.2f}% ({100 * min(changed_shares):.2f}.."
                     f"{100 * max(changed_shares):.2f})", f"{statistics.median(factors) / 1e6:.2f} MB" if factors else "",
                     f"{statistics.median(deltas) / 1e6:.2f} MB", f"{full / 1e6:.1f} MB",
                     f"{statistics.median(deltas) / full:.3f}"])
        print(report.row(rows[-1]), flush=True)
    return rows, shares


def projected(shares: dict) -> list[list]:
    """Part 3: the three payloads at the paper's 7B and 27B (r = 256) from the measured shares."""
    import train
    from sync_payload import target_shapes

    rows = []
    for preset in ("7b", "27b"):
        shapes = list(target_shapes(train.PRESETS[preset].model)[0].values())
        full = sum(d * k * 2 for d, k in shapes)
        factor = sum(d * 256 * 2 for d, _ in shapes)
        for method, share in shares.items():
            delta = sum(LAYER_HEADER + min(d * k / 8, share * d * k * expected_gap_bytes(share)) + 2 * share * d * k
                        for d, k in shapes)
            rows.append([preset, method, f"{100 * share:.2f}%", f"{factor / 2**20:.0f} MiB" if method == "logra" else "",
                         f"{delta / 2**20:.0f} MiB", f"{full / 2**30:.2f} GiB", f"{delta / full:.3f}"])
            print(report.row(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "sync-delta"))
    p.add_argument("--checkpoint", required=True, help="SmolLM2-135M-Instruct (python bench/real_model.py --checkpoint DIR)")
    p.add_argument("--updates", type=int, default=5, help="updates of each optimizer on SmolLM2 (5)")
    p.add_argument("--skip-tiny", action="store_true", help="part 2 and 3 only")
    args = report.parse_args(p, "sync_delta")
    header = ["model", "optimizer", "bf16 elements changed per update (median, min..max)", "factor sync",
              "exact sparse delta", "full bf16", "delta / full"]
    print(report.table(header, []), flush=True)
    rows = [] if args.skip_tiny else tiny_runs(args.out)
    more, shares = real_model(args.checkpoint, args.updates)
    rows += more
    table = report.table(header, rows)
    projection = report.table(["preset (r = 256)", "optimizer", "share changed (SmolLM2's)", "factor sync",
                               "exact sparse delta (projected)", "full bf16", "delta / full"], projected(shares))
    note = ("Per update, over every target weight. Tiny: `python train.py` runs (150 updates) with a checkpoint "
            "every update; SmolLM2-135M: the paper's settings, " + f"{args.updates} updates each, rank 64. "
            "Sparse delta: 2 bytes a changed bf16 value, the positions as a bitmap or LEB128 gaps (the smaller, "
            "per weight), 16 bytes a weight.")
    print("\n" + projection + "\n\n" + note)
    if args.markdown:
        report.publish("sync_delta", note + "\n\n" + table + "\n\n" + projection)


if __name__ == "__main__":
    main()

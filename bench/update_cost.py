"""LoGRA's whole update against AdamW's at the paper's proportions, at several model widths.

The paper's Table 1 runs 128 prompts per update on 4 training ranks, so each rank trains on
32 responses in micro-batches of 2, and probes the KL on 2 of them (arXiv:2610.06647). Per
width, one process per method (so that each peak memory is its own) times every phase of an
update on one rank, rollout excluded:

- both: one micro-batch of 2 responses forward and backward (LoGRA into the sketches, AdamW
  into fp32 gradients), timed and scaled by 16 to the rank's 32 responses: the one scaled
  figure, said in the table;
- LoGRA: RowAdam's prepare, the KL probe on 2 responses (keeping the logits of its first 256
  scored positions), the merge, the realised KL on the same 2 responses, the factor payload
  (encode) and the engine's merge of it (sync.EngineWeights on a bf16 copy in this process:
  rebuild fp32 from bf16 + int16, merge, split);
- AdamW: its step, the full bf16 payload (encode) and the engine's load of it.

Memory per rank: the peak during the trainer's phases (the process's peak RSS, torch and
Python included), and the state counted from the
tensors (weights, gradients, optimizer state). The engine's copy is made after that peak.

The same comparison on a GPU, at the paper's 7B at full depth with one whole update timed end to
end (not one micro-batch multiplied), is the device check's `depth7b` step (bench/gpu_check.py):
one instrument for that figure. The test suite runs `--widths tiny` here.

    python bench/update_cost.py [--widths 44m,100m,7b-2l] [--reps 3] [--markdown]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import kl_control  # noqa: E402
from infra import probe_decoder  # noqa: E402
import ppo  # noqa: E402
import report  # noqa: E402  (bench/report.py)
from infra.batched import BatchedRowAdam  # noqa: E402
import sketch  # noqa: E402
import sync  # noqa: E402
from infra import wire  # noqa: E402
from infra.checksum import checksums  # noqa: E402
from infra.engine_weights import StreamedEngineWeights  # noqa: E402

GIB = 2**30
RESPONSES, MICRO, PROBED, KL_POSITIONS = 32, 2, 2, 256  # per rank, as in the paper's Table 1
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064)
# name: (Qwen2 config, tokens per response, rank r)
WIDTHS = {
    "tiny": (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512), 32, 16),
    "44m": (dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=32000), 256, 128),
    "100m": (dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=32000), 256, 256),
    "7b-2l": (dict(QWEN_7B, num_hidden_layers=2), 128, 256),  # two decoder layers of Qwen2.5-7B's widths
}


def build(width):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = dict(tie_word_embeddings=False, max_position_embeddings=4096)
    config.update(WIDTHS[width][0])
    return Qwen2ForCausalLM(Qwen2Config(**config)).eval()


def batch(width):
    """Two responses of the width's length, the last three quarters "generated"."""
    length = WIDTHS[width][1]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, WIDTHS[width][0]["vocab_size"], (MICRO, length), generator=g)
    mask = torch.zeros(MICRO, length, dtype=torch.bool)
    mask[:, length // 4:] = True
    return ids, mask, torch.tensor([1.0, -1.0])


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def one(width, method, reps):
    """Phase times (s, medians), peak and state bytes of one method at one width: a dict."""
    model = build(width)
    ids, mask, adv = batch(width)
    modules = sketch.target_modules(model)
    rank = WIDTHS[width][2]

    def backward():
        logp = ppo.response_logprobs(model(input_ids=ids, use_cache=False).logits, ids)
        loss, _ = ppo.policy_loss(logp.float(), adv, mask, rollout_logprobs=logp.detach().float(),
                                  num_tokens=int(mask.sum()) * RESPONSES // MICRO)
        loss.backward()

    times, phase = {}, "set-up"
    try:
        if method == "logra":
            layers = sketch.attach(model, rank=rank, seed=0)
            opt = BatchedRowAdam(layers, seed=0)
            state = [p for p in model.parameters()] + [l.sketch for l in layers] + [l.signs for l in layers] \
                + opt.moments + opt._u
        else:
            for p in model.parameters():
                p.requires_grad_(False)
            targets = [m.weight.requires_grad_(True) for m in modules.values()]
            opt = torch.optim.AdamW(targets, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
        for rep in range(reps + 1):  # the first round warms up
            laps = {}
            phase = "forward and backward"
            _, laps["train (x16 to 32 responses)"] = timed(backward)
            laps["train (x16 to 32 responses)"] *= RESPONSES // MICRO
            if method == "logra":
                phase = "prepare"
                _, laps["prepare"] = timed(opt.prepare)
                phase = "probe"
                probe, laps["probe"] = timed(lambda: probe_decoder.fast_probe(
                    model, layers, opt.directions, ids, mask, max_responses=PROBED, keep_positions=KL_POSITIONS))
                alpha = kl_control.solve_alpha(probe.kl1, budget=2e-4)
                phase = "merge"
                factors, laps["merge"] = timed(lambda: opt.merge(alpha))
                phase = "realised KL"
                _, laps["realised KL"] = timed(lambda: kl_control.realised_kl(probe, model, ids, mask))
                del probe
                phase = "payload"
                payload = sync.Payload(opt.update - 1, 0, rank, {l.name: f for l, f in zip(layers, factors)})
                buf, laps["payload (encode)"] = timed(lambda: wire.encode(payload))
            else:
                phase = "step"
                _, laps["step"] = timed(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
                phase = "payload"
                weights = {n: m.weight for n, m in modules.items()}
                buf, laps["payload (encode)"] = timed(lambda: wire.encode(sync.full_payload(
                    weights, update=rep + 1, base_seed=0, rank=rank)))
            if rep:
                for k, v in laps.items():
                    times.setdefault(k, []).append(v)
            if rep < reps:
                del buf
        peak = peak_bytes()
        if method == "adam":  # its fp32 gradients exist from backward to the step
            state = [p for p in model.parameters()] + [torch.empty_like(p) for p in targets] \
                + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        state_bytes = sum(t.numel() * t.element_size() for t in state)
        params = sum(p.numel() for p in model.parameters())
        # The engine's side, on a bf16 copy made once the trainer is gone (it has its own GPU in a run).
        update = opt.update - 1 if method == "logra" else 0
        del model, opt, state, modules
        layers = targets = None  # the last references to the trainer's tensors
        phase = "engine"
        engine = StreamedEngineWeights(build(width).to(torch.bfloat16), base_seed=0, rank=rank, update=update,
                                       checksums=checksums)
        payload = wire.decode(buf)
        if method == "logra":
            _, engine_time = timed(lambda: engine.apply(payload))
        else:
            _, engine_time = timed(lambda: engine.load_full(payload))
    except torch.OutOfMemoryError:
        return {"width": width, "method": method, "oom": phase}
    result = {k: statistics.median(v) for k, v in times.items()}
    result["engine's merge" if method == "logra" else "engine's load"] = engine_time
    return {"width": width, "method": method, "times": result, "peak": peak, "state": state_bytes,
            "payload": buf.numel(), "params": params}


def measure(width, method, reps):
    """`one` in its own process: its peak memory is its own."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", width, method, "--reps", str(reps)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{width} {method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def size(n):
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / 2**20:.1f} MiB"


def tables(results, reps):
    header = ["width", "params", "method", "train (x16)", "LoGRA: prepare + probe + merge + realised KL",
              "step", "payload encode + engine", "payload", "update", "LoGRA / AdamW", "peak memory",
              "state (weights + grads + optimizer)"]
    rows, phases = [], []
    for width in dict.fromkeys(r["width"] for r in results):
        pair = {r["method"]: r for r in results if r["width"] == width}
        totals = {m: sum(r["times"].values()) for m, r in pair.items() if "times" in r}
        for method in ("logra", "adam"):
            r = pair[method]
            if "oom" in r:
                rows.append([width, "", method, f"does not fit: out of memory in {r['oom']}"])
                continue
            t = r["times"]
            extra = sum(t.get(k, 0.0) for k in ("prepare", "probe", "merge", "realised KL"))
            sync_t = t["payload (encode)"] + t.get("engine's merge", t.get("engine's load", 0.0))
            ratio = f"{totals['logra'] / totals['adam']:.2f}x" if method == "logra" and len(totals) == 2 else ""
            rows.append([width, f"{r['params'] / 1e6:.{0 if r['params'] >= 1e7 else 2}f}M", "LoGRA" if method == "logra" else "AdamW",
                         f"{t['train (x16 to 32 responses)'] * 1e3:.0f} ms", f"{extra * 1e3:.0f} ms" if extra else "",
                         f"{t['step'] * 1e3:.0f} ms" if "step" in t else "", f"{sync_t * 1e3:.0f} ms",
                         size(r["payload"]), f"{totals[method] * 1e3:.0f} ms", ratio, size(r["peak"]),
                         size(r["state"])])
            if method == "logra":
                phases.append(f"{width}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items()))
    where = f"This CPU ({torch.get_num_threads()} threads), fp32"
    caption = (f"One rank's update, rollout excluded, at the paper's proportions: {RESPONSES} responses per rank "
               f"in micro-batches of {MICRO}, the probe and the realised KL on {PROBED} of them ({KL_POSITIONS} "
               f"positions kept); the forward and backward of one micro-batch is timed and multiplied by "
               f"{RESPONSES // MICRO}, everything else is timed as it runs once per update. {where}; median of {reps}.")
    return caption + "\n\n" + report.table(header, rows) + "\n\nLoGRA's phases: " + "; ".join(phases)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default=None, help=f"comma-separated, of {', '.join(WIDTHS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--one", nargs=2, metavar=("WIDTH", "METHOD"), help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the results as one JSON list")
    args = report.parse_args(p, "update_cost")
    if args.one:
        print(json.dumps(one(*args.one, args.reps)))
        return
    widths = (args.widths or "44m,100m,7b-2l").split(",")
    unknown = [w for w in widths if w not in WIDTHS]
    if unknown:
        raise SystemExit(f"unknown widths {unknown}: choose from {', '.join(WIDTHS)}")
    results = [measure(w, m, args.reps) for w in widths for m in ("logra", "adam")]
    text = tables(results, args.reps)
    print(text)
    if args.json:
        print(json.dumps(results))
    if args.markdown:
        report.publish("update_cost", text)


if __name__ == "__main__":
    main()

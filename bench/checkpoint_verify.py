"""What verifying a checkpoint costs: sha256 speed on this CPU, the bytes one rank hashes in a
7B checkpoint (from the shapes in train.PRESETS["7b"]), and the measured wall time of verifying
a tiny-preset checkpoint.

A resume verifies before it loads: each rank hashes its own shards (train.check_files), all
ranks at once, so the added time is one rank's bytes over the hashing speed. A save hashes the
same bytes once more, right after writing them. Both read the files once more than before:
from the page cache, as measured here, right after a save; from disk on a cold resume, where
the disk's read speed, not sha256, may set the pace.

    python bench/checkpoint_verify.py
"""

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kl_control  # noqa: E402
import ppo  # noqa: E402
import rowadam  # noqa: E402
import sketch  # noqa: E402
import train  # noqa: E402

GIB = 2**30


def hashing_speed(reps=3) -> tuple[float, float]:
    """Bytes per second of sha256: over a 1 GiB buffer in memory, in the chunks file_sha256
    uses, and through train.file_sha256 over a 256 MiB file just written (in the page cache).
    The best of `reps`: the machine is shared, and the best is the least disturbed."""
    import hashlib

    buffer = memoryview(bytes(GIB))
    in_memory = []
    for _ in range(reps):
        t0 = time.perf_counter()
        digest = hashlib.sha256()
        for i in range(0, GIB, train.HASH_CHUNK_BYTES):
            digest.update(buffer[i:i + train.HASH_CHUNK_BYTES])
        digest.hexdigest()
        in_memory.append(GIB / (time.perf_counter() - t0))
    del buffer
    from_file = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "blob")
        with open(path, "wb") as f:
            f.write(os.urandom(GIB // 4))
        for _ in range(reps):
            t0 = time.perf_counter()
            train.file_sha256(path)
            from_file.append(GIB / 4 / (time.perf_counter() - t0))
    return max(in_memory), max(from_file)


def tiny_checkpoint(run_dir):
    """The tiny preset's model and RowAdam state, saved by train.save_checkpoint (the files a
    tiny run writes; the values are the untrained ones)."""
    cfg = train.resolve_config(train.parse_args([]))
    model = train.build_model(cfg, train.Arithmetic(cfg["seed"], cfg["eval_problems"]).vocab_size)
    layers = sketch.attach(model, rank=cfg["rank"], seed=cfg["seed"])
    opt = rowadam.RowAdam(layers, base_seed=cfg["seed"], update_ratio=cfg["update_ratio"])
    train.save_checkpoint(run_dir, model, opt, "logra", ppo.RunningBaseline(weight=0.1),
                          kl_control.Mismatch(momentum=0.7), 1, cfg, 0)
    return "checkpoint-1"


def main():
    in_memory, from_file = hashing_speed()
    print(f"sha256 on this CPU: {in_memory / 1e6:.0f} MB/s over a 1 GiB buffer in memory, "
          f"{from_file / 1e6:.0f} MB/s through train.file_sha256 (a 256 MiB file in the page cache)\n")

    # One rank's share of a 7B checkpoint over 4 ranks (rank 0, the largest): its fp32 rows of
    # every weight, and its rows of the optimizer state.
    m = train.memory_estimate(train.PRESETS["7b"]["model"], 4, 256)
    rows = [("LoGRA (fp32 weights + RowAdam's row moments v)", m["weights"] + m["logra_moments"]),
            ("AdamW, for scale (fp32 weights + 2 moments per target)", m["weights"] + m["adam_moments"])]
    print("| checkpoint | bytes per rank | verify at the file speed | at the in-memory speed |")
    print("|---|---|---|---|")
    for label, size in rows:
        print(f"| 7B, 4 ranks, {label} | {size / 1e9:.2f} GB ({size / GIB:.2f} GiB) | {size / from_file:.1f} s "
              f"| {size / in_memory:.1f} s |")

    with tempfile.TemporaryDirectory() as run_dir:
        name = tiny_checkpoint(run_dir)
        size = sum(os.path.getsize(os.path.join(run_dir, name, f)) for f in os.listdir(os.path.join(run_dir, name)))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert train.check_checkpoint(run_dir, name, 0, 1) is None
            times.append(time.perf_counter() - t0)
    print(f"| tiny, 1 rank, measured (median of 20) | {size / 1e6:.2f} MB | {statistics.median(times) * 1e3:.2f} ms "
          f"| |")


if __name__ == "__main__":
    main()

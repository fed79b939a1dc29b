"""What verifying a checkpoint costs: sha256 speed on this CPU, the bytes one rank hashes in a
7B checkpoint (from the shapes in train.PRESETS["7b"]), and the measured wall time of verifying
a tiny-preset checkpoint.

A resume verifies before it loads: each rank hashes its own shards (checkpoint.check_files), all
ranks at once, so the added time is one rank's bytes over the hashing speed. A save hashes the
same bytes once more, right after writing them. Both read the files once more than before:
from the page cache, as measured here, right after a save; from disk on a cold resume, where
the disk's read speed, not sha256, may set the pace.

    python bench/checkpoint_verify.py [--markdown]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import checkpoint  # noqa: E402
import kl_control  # noqa: E402
from infra import memory_plan  # noqa: E402
from infra import lifecycle  # noqa: E402
from infra import policy  # noqa: E402
import ppo  # noqa: E402
import report  # noqa: E402  (bench/report.py)
from infra.batched import BatchedRowAdam  # noqa: E402
import sketch  # noqa: E402
from infra import tasks  # noqa: E402
import train  # noqa: E402

GIB = 2**30


def hashing_speed(reps=3) -> tuple[float, float]:
    """Bytes per second of sha256: over a 1 GiB buffer in memory, in the chunks file_sha256
    uses, and through checkpoint.file_sha256 over a 256 MiB file just written (in the page cache).
    The best of `reps`: the machine is shared, and the best is the least disturbed."""
    import hashlib

    buffer = memoryview(bytes(GIB))
    in_memory = []
    for _ in range(reps):
        t0 = time.perf_counter()
        digest = hashlib.sha256()
        for i in range(0, GIB, checkpoint.HASH_CHUNK_BYTES):
            digest.update(buffer[i:i + checkpoint.HASH_CHUNK_BYTES])
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
            checkpoint.file_sha256(path)
            from_file.append(GIB / 4 / (time.perf_counter() - t0))
    return max(in_memory), max(from_file)


def tiny_checkpoint(run_dir):
    """The tiny preset's model and RowAdam state, saved as train.py saves them (checkpoint.save
    of lifecycle.run_state: the files a tiny run writes; the values are the untrained ones)."""
    cfg = train.PRESETS["tiny"]
    model = policy.build_model(cfg.model, tasks.Arithmetic(cfg.seed, cfg.eval_problems).vocab_size, cfg.seed)
    layers = sketch.attach(model, rank=cfg.sketch_rank, seed=cfg.seed)
    opt = BatchedRowAdam(layers, seed=cfg.seed, update_ratio=cfg.update_ratio)
    state = lifecycle.run_state(model, opt, True, ppo.RunningBaseline(weight=0.1), kl_control.Mismatch(momentum=0.7), 1)
    checkpoint.save(run_dir, state, 1, rank=0, world=1)
    return "checkpoint-1"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = report.parse_args(p, "checkpoint_verify")
    in_memory, from_file = hashing_speed()
    speed = (f"sha256 on this CPU: {in_memory / 1e6:.0f} MB/s over a 1 GiB buffer in memory, "
             f"{from_file / 1e6:.0f} MB/s through checkpoint.file_sha256 (a 256 MiB file in the page cache)")
    print(speed + "\n")

    # One rank's share of a 7B checkpoint over 4 ranks (rank 0, the largest): its fp32 rows of
    # every weight, and its rows of the optimizer state.
    m = memory_plan.estimate(train.PRESETS["7b"].model, 4, 256)
    rows = [("LoGRA (fp32 weights + RowAdam's row moments v)", m["weights"] + m["logra_moments"]),
            ("AdamW, for scale (fp32 weights + 2 moments per target)", m["weights"] + m["adam_moments"])]
    header = ["checkpoint", "bytes per rank", "verify at the file speed", "at the in-memory speed"]
    table_rows = [[f"7B, 4 ranks, {label}", f"{size / 1e9:.2f} GB ({size / GIB:.2f} GiB)", f"{size / from_file:.1f} s",
                   f"{size / in_memory:.1f} s"] for label, size in rows]
    print(report.table(header, table_rows))

    with tempfile.TemporaryDirectory() as run_dir:
        name = tiny_checkpoint(run_dir)
        size = sum(os.path.getsize(os.path.join(run_dir, name, f)) for f in os.listdir(os.path.join(run_dir, name)))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert checkpoint.check_checkpoint(run_dir, name, 0, 1) is None
            times.append(time.perf_counter() - t0)
    table_rows.append(["tiny, 1 rank, measured (median of 20)", f"{size / 1e6:.2f} MB",
                       f"{statistics.median(times) * 1e3:.2f} ms", ""])
    print(report.row(table_rows[-1]))
    if args.markdown:
        report.publish("checkpoint_verify", speed + "\n\n" + report.table(header, table_rows))


if __name__ == "__main__":
    main()

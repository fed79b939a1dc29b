"""Run a function in several gloo processes on this machine (CPU), for the distributed tests."""

import os
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, fn, args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank done before any tears the group down
    finally:
        dist.destroy_process_group()
    # A finished worker leaves without the interpreter's teardown: with torch 2.13's gloo, the
    # process sometimes aborted there (SIGABRT, "terminate called without an active
    # exception"), after its work and results were complete, in about 1 run in 8 of a 2-rank
    # test, with or without the barrier. A failure above still raises and exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, world, *args):
    """fn(rank, world, *args) in `world` processes; fn must be a module-level function.

    Results come back through files or queues the caller passes in `args`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world, init_file, fn, args), nprocs=world,
                           join=True, start_method="spawn")

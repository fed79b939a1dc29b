"""Run a function in several gloo processes on this machine (CPU), for the distributed tests."""

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, fn, args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Every rank done before any tears the group down: a gloo group destroyed while its
        # peer still works (rank 0 saving results) aborted the process now and then (SIGABRT,
        # "terminate called without an active exception"; 2 runs in 8 of one 2-rank test).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world, *args):
    """fn(rank, world, *args) in `world` processes; fn must be a module-level function.

    Results come back through files or queues the caller passes in `args`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world, init_file, fn, args), nprocs=world,
                           join=True, start_method="spawn")

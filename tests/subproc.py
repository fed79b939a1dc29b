"""What the tests that start train.py or an engine in a subprocess share: the repository root,
and the environment such a process gets (one thread, offline, not part of a torchrun world)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    e.pop("WORLD_SIZE", None)
    e.update(extra)
    return e

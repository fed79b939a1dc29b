"""The suite's two tiers, and what the tests share for the whole session.

    python -m pytest -q tests            the fast tier: every module, refusals and dry runs in
                                         this process (in_process.py), one vLLM CPU engine for
                                         the session, tiny shapes; minutes on 2 cores
    python -m pytest -q tests --full     the whole suite: the fast tier and the slow one
    python -m pytest -q tests --full -m slow    the slow tier alone (.ci/run runs the two apart
                                                and prints each one's time)

A test marked `slow` is left out of the fast tier (deselected, not skipped): it starts several
processes (gloo ranks, torchrun, two "nodes"), runs train.py through vLLM engines, or injects
faults (SIGKILL, SIGTERM, full and read-only file systems, engines killed mid-sync).

Shared for the session: `runs`, the folder where tiny runs cache their base policy's warm-up
(every run of the same warm-up and seed loads the one made first), which starts with the tiny
preset's own for seed 0 (tests/data/base-tiny-seed0.pt: its 3000-step warm-up, made once by
`python train.py`, right about a third of the time), so that every machine trains from the same
bits and every batch of tests/test_train.py's runs is likely to hold a right answer, whatever
a CPU's rounding samples (after a change of the warm-up or the task, its name no longer
matches, the runs warm up again, and test_smoke_run says so); `tiny_math`, the paper's
task formats at toy size (tests/tiny_math.py: a checkpoint, its tokenizer, train and eval
files); `cpu_engine`, one vLLM CPU engine on that checkpoint that keeps the exact master
(factor payloads), and `cpu_delta_engine`, one that keeps none (sparse deltas).
"""

import os
import shutil

import pytest

from subproc import ROOT, engine_processes

RANK, SEED = 16, 5  # the session engines' sketch rank and base seed


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="the whole suite: the slow tier too (tests marked slow)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier, left out unless --full (several processes, train.py "
                                       "through vLLM, fault injection)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """One folder for the session's tiny runs: their base policy is cached beside their run
    directories (infra/policy.py), so that the warm-up runs once; the tiny preset's own for
    seed 0 is there from the start."""
    import train
    from infra import policy, tasks

    folder = tmp_path_factory.mktemp("runs")
    cfg = train.PRESETS["tiny"]
    warmup = dict(steps=cfg.warmup_steps, batch=cfg.warmup_batch, lr=cfg.warmup_lr, unboxed=cfg.warmup_unboxed)
    cached = policy.base_policy_path(cfg.model, tasks.Arithmetic(0, cfg.eval_problems), str(folder / "run"),
                                     preset="tiny", seed=0, warmup=warmup)
    shutil.copyfile(os.path.join(ROOT, "tests", "data", "base-tiny-seed0.pt"), cached)
    return folder


@pytest.fixture(scope="session")
def tiny_math(tmp_path_factory):
    import tiny_math

    return tiny_math.make(str(tmp_path_factory.mktemp("tiny-math")))


def _engine(tiny_math, folder, **kw):
    from infra import vllm_engine

    log = str(folder / "engine.log")
    engine = vllm_engine.VLLMEngine(model_path=tiny_math["model"], context=128, seed=SEED, sketch_rank=RANK, gpu=None,
                                    device="cpu", log_path=log, timeout=300, gpu_memory_utilization=0.1, **kw)
    yield engine
    engine.close()
    assert not engine_processes(str(folder))  # vLLM's engine core and workers are gone too


@pytest.fixture(scope="session")
def cpu_engine(tiny_math, tmp_path_factory):
    """A vLLM CPU engine that keeps the trainer's exact master: factor payloads and full weights."""
    yield from _engine(tiny_math, tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="session")
def cpu_delta_engine(tiny_math, tmp_path_factory):
    """A vLLM CPU engine without a master (exact=False): sparse deltas and full weights only."""
    yield from _engine(tiny_math, tmp_path_factory.mktemp("delta-engine"), exact=False)


@pytest.fixture(autouse=True)
def _no_torchrun_variables(monkeypatch):
    """A test starts outside any torchrun world, whatever the shell that started pytest had."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

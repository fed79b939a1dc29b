"""examples/: each runs at toy size and learns; LoGRA's weights move exactly as its merge says."""

import os
import statistics
import sys

import pytest
import torch

from subproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))

import minimal_loop  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """The example runs on one thread; the session's count is given back after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_minimal_loop_learns_with_both_optimizers():
    """40 updates from chance (1/32 good tokens): both optimizers raise the reward several fold."""
    for method in ("logra", "adamw"):
        rewards = minimal_loop.train(method, updates=40, batch=32, seed=0, log=lambda line: None)["rewards"]
        first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
        assert last > 0.1 and last > 3 * first, (method, first, last)


def test_minimal_loop_moves_the_weights_as_logra_merges():
    """One update of the example: every non-target parameter bit for bit as it was; every target
    weight W - F A, F the merged factors and A the update's projection: F A recomputed in
    float64 and rounded once to fp32, as rowadam.py states its merge (within the one fp32 ulp
    that the bf16-tie rule may add)."""
    model = minimal_loop.tiny_model(0)
    layers = minimal_loop.sketch.attach(model, seed=0)
    opt = minimal_loop.BatchedRowAdam(layers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {}
    real_merge = opt.merge

    def merge(alpha):  # the projections A_t as the merge uses them, and the factors it returns
        projections = [layer.projection.double() for layer in layers]
        factors = real_merge(alpha)
        merged.update({layer.name: (f.double(), a) for layer, f, a in zip(layers, factors, projections)})
        return factors

    opt.merge = merge
    g = torch.Generator().manual_seed(0)
    ids, mask = minimal_loop.rollout(model, torch.randint(0, minimal_loop.VOCAB, (32, minimal_loop.PROMPT),
                                                          generator=g), g)
    reward = (ids[:, minimal_loop.PROMPT:] == minimal_loop.GOOD).float().mean(dim=1)
    alpha, kl_pred, kl_real = minimal_loop.update_logra(model, layers, opt, ids, mask, reward - reward.mean())
    assert 0 < alpha <= 3.0 and kl_pred > 0 and kl_real >= 0
    targets = {f"{layer.name}.weight" for layer in layers}
    for name, p in model.named_parameters():
        if name not in targets:
            assert torch.equal(p, before[name]), name
    moved = 0
    for layer in layers:
        f, a = merged[layer.name]
        expected = before[f"{layer.name}.weight"] - (f @ a).float()
        w = layer.module.weight.detach()
        ulp = torch.finfo(torch.float32).eps * expected.abs().clamp(min=torch.finfo(torch.float32).tiny)
        assert ((w - expected).abs() <= ulp).all(), layer.name
        moved += int((w != before[f"{layer.name}.weight"]).sum())
    assert moved > 0.5 * sum(layer.module.weight.numel() for layer in layers)  # the step touched the weights

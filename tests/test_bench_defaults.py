"""bench/defaults.py's --why instrument: its fixed steps are the sizes it reports, measured here
from the weights themselves (the norm of what one update changed), not from its own formulas."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import defaults  # noqa: E402  bench/defaults.py

import sketch  # noqa: E402


class Kept(defaults.Lookback):
    """The base loop for one update of 16 responses, keeping the trained model for the test."""

    def heldout(self, model):
        self.trained = model
        return super().heldout(model)


def moved(kind, ratio, seed=3):
    """(per target layer: ||W_after - W_before||, ||W_before||) after one why_run update."""
    env = Kept(batch=16, updates=1)
    before = {name: m.weight.detach().clone() for name, m in sketch.target_modules(env.model(seed)).items()}
    out = defaults.why_run(env, kind, seed, ratio)
    assert out["kl_median"] > 0 and 0 <= out["heldout"] <= 1
    after = {name: m.weight.detach() for name, m in sketch.target_modules(env.trained).items()}
    return [((after[n].double() - w.double()).norm().item(), w.double().norm().item()) for n, w in before.items()]


@pytest.mark.parametrize("kind", ["dense", "sketch"])
def test_a_fixed_step_is_its_share_of_all_the_weights(kind):
    """`dense` and `sketch` (RowAdam's one scale c for all layers): the update's norm over all
    target layers is `ratio` times theirs, to 1e-6 without the sketch and to 1% with it (the
    factor is rounded to bf16 before the merge); the layers' own shares differ."""
    layers = moved(kind, 0.02)
    total = sum(d * d for d, _ in layers) ** 0.5 / sum(w * w for _, w in layers) ** 0.5
    assert total == pytest.approx(0.02, rel=1e-6 if kind == "dense" else 1e-2)
    shares = [d / w for d, w in layers]
    assert max(shares) > 1.5 * min(shares), shares


@pytest.mark.parametrize("kind", ["dense per layer", "sketch per layer"])
def test_a_fixed_step_per_layer_is_that_share_of_each_layer(kind):
    """`... per layer`: every target layer moves by `ratio` times its own norm."""
    for d, w in moved(kind, 0.03):
        assert d / w == pytest.approx(0.03, rel=1e-6 if kind.startswith("dense") else 1e-2)


def test_why_run_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be"):
        defaults.why_run(Kept(batch=16, updates=1), "sgd", 0, 0.01)

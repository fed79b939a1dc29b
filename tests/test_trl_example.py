"""examples/trl_grpo.py: LoGRA inside TRL's GRPOTrainer moves only its targets, each exactly as
its merges say, and both it and TRL's own AdamW raise the toy's reward. Skipped without the
`trl` extra (`pip install -e ".[trl]"`; .ci/setup installs it)."""

import os
import statistics
import sys

import pytest
import torch

pytest.importorskip("trl", reason="the trl extra is not installed: pip install -e '.[trl]' (.ci/setup installs it)")

from subproc import ROOT  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "examples"))
_set_by_the_example = {"HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"} - set(os.environ)

import trl_grpo  # noqa: E402
from rowadam import RowAdam  # noqa: E402

for _key in _set_by_the_example:  # the script's own defaults, not the rest of the session's
    os.environ.pop(_key, None)

STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def no_telemetry():
    """TRL's trainers ping the Hub when they start; huggingface_hub read the environment when it
    was first imported, perhaps before the example set HF_HUB_DISABLE_TELEMETRY, so say it here."""
    import huggingface_hub.constants

    mp = pytest.MonkeyPatch()
    mp.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def runs():
    """The example's main entry, both optimizers, STEPS steps each; every LoGRA merge recorded:
    the weights before and after it, its factors F and its projections A_t."""
    merges = []
    real_merge = RowAdam.merge

    def merge(self, alpha):
        before = [layer.module.weight.detach().clone() for layer in self.layers]
        projections = [layer.projection.double() for layer in self.layers]
        factors = real_merge(self, alpha)
        after = [layer.module.weight.detach().clone() for layer in self.layers]
        merges.append([(layer.name, b, f.double(), a, w)
                       for layer, b, f, a, w in zip(self.layers, before, factors, projections, after)])
        return factors

    mp, threads = pytest.MonkeyPatch(), torch.get_num_threads()
    mp.setattr(RowAdam, "merge", merge)
    try:
        result = trl_grpo.main(["--steps", str(STEPS)])  # prints every step's line (pytest -s shows them)
    finally:
        mp.undo()
        torch.set_num_threads(threads)  # main() sets one thread
    initial = trl_grpo.tiny_model(trl_grpo.make_tokenizer(), 0)  # the weights both runs started from
    return result, merges, {n: p.detach() for n, p in initial.named_parameters()}


def test_logra_moves_its_targets_exactly_as_its_merges_say(runs):
    """Every non-target parameter bit for bit as it was; one merge per step; each merge changes a
    target weight to W - F A, F the factors it returned and A its projection (F A in float64,
    rounded once to fp32, within the one fp32 ulp that the bf16-tie rule may add); and between
    merges, nothing else (TRL, its scheduler, zero_grad) touches the weights."""
    result, merges, initial = runs
    model = result["logra"]["model"]
    final = dict(model.named_parameters())
    targets = {f"{name}.weight" for name in trl_grpo.sketch.target_modules(model)}
    assert len(targets) == 14  # q, k, v, o, gate, up, down in each of 2 layers
    for name, p in final.items():
        if name not in targets:
            assert torch.equal(p.detach(), initial[name]), name
    assert len(merges) == STEPS
    now = {name: initial[name] for name in targets}
    for step, merge in enumerate(merges):
        assert len(merge) == len(targets)
        for name, before, f, a, after in merge:
            assert torch.equal(before, now[f"{name}.weight"]), (step, name)  # untouched since the last merge
            expected = before - (f @ a).float()
            ulp = torch.finfo(torch.float32).eps * expected.abs().clamp(min=torch.finfo(torch.float32).tiny)
            assert ((after - expected).abs() <= ulp).all(), (step, name)
            assert (after != before).any(), (step, name)
            now[f"{name}.weight"] = after
    for name in targets:
        assert torch.equal(final[name].detach(), now[name]), name
        assert (final[name].detach() != initial[name]).float().mean() > 0.5, name  # the steps touched W


def test_adamw_trains_the_same_weights(runs):
    """TRL's AdamW moved the same target weights, and no other."""
    result, _, initial = runs
    model = result["adamw"]["model"]
    targets = {f"{name}.weight" for name in trl_grpo.sketch.target_modules(model)}
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), initial[name]) != (name in targets), name


def test_both_optimizers_raise_the_reward(runs):
    """From chance (1/29 of the letters are "a", about 0.03): the last 5 steps' mean reward above
    0.1 and three times the first 5 steps', with LoGRA and with TRL's AdamW. (Seeds 0, 1, 2 gave
    LoGRA 6-8x and AdamW 13-19x in 20 steps.)"""
    result, _, _ = runs
    for method in ("logra", "adamw"):
        rewards = result[method]["rewards"]
        assert len(rewards) == STEPS
        first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
        assert last > 0.1 and last > 3 * first, (method, first, last)


def test_a_trainer_checkpoint_resumes_logra_bit_for_bit(tmp_path):
    """4 steps in one run that saves a Trainer checkpoint at step 2, against a run resumed from
    it: the same RowAdam counter and moments, and the same weights, bit for bit (the checkpoint
    holds RowAdam's state and the calibration's rho: LoGRAOptimizer.state_dict)."""
    whole = trl_grpo.make_trainer("logra", steps=4, seed=0, output_dir=str(tmp_path), save_strategy="steps",
                                  save_steps=2)
    whole.train()
    resumed = trl_grpo.make_trainer("logra", steps=4, seed=0, output_dir=str(tmp_path))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.logra.rowadam.update == whole.logra.rowadam.update == 4
    assert resumed.logra.calibration.log_scale == whole.logra.calibration.log_scale  # rho, checkpointed too
    for a, b in zip(whole.logra.rowadam.moments, resumed.logra.rowadam.moments):
        assert torch.equal(a, b)
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name

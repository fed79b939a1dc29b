"""lora.py: peft's adapters on the seven targets, against the plain model and a dense reference."""

import copy

import pytest
import torch

import sketch
from infra import lora
from tiny import tiny_batch, tiny_qwen2

RANK, ALPHA, SEED = 8, 32.0, 3


def adapted(seed=SEED):
    model = tiny_qwen2()
    base = copy.deepcopy(model)
    trainable = lora.attach(model, rank=RANK, alpha=ALPHA, seed=seed)
    return base, model, trainable


def test_the_adapted_model_starts_as_the_base_and_only_adapters_train():
    base, model, trainable = adapted()
    ids = tiny_batch(batch=3, length=9)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)  # B = 0
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 2 * 7 * 2 == len(trainable)  # A and B of 7 targets in 2 layers
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    assert set(lora.layers(model)) == set(sketch.target_modules(base))  # the targets, under their own names
    for name, module in lora.layers(model).items():
        a = module.lora_A[lora.ADAPTER].weight
        assert a.shape == (RANK, module.base_layer.in_features) and a.abs().max() <= a.shape[1] ** -0.5
        assert module.scaling[lora.ADAPTER] == ALPHA / RANK


def test_merged_weight_is_the_layer_the_model_computes():
    """After a step on A and B, each target computes F.linear(x, merged_weight) + bias, where
    merged_weight = W + (alpha / r) B A, checked against a float64 recomputation."""
    _, model, trainable = adapted()
    ids = tiny_batch(batch=2, length=7)
    loss = model(input_ids=ids).logits.square().mean()
    loss.backward()
    with torch.no_grad():
        for p in trainable:
            p -= 0.5 * p.grad / (p.grad.norm() + 1e-12)  # B moves off zero
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name, module in lora.layers(model).items():
        if module.base_layer.in_features != x.shape[1]:
            continue
        w, a, b = (t.double() for t in (module.base_layer.weight, module.lora_A["default"].weight,
                                          module.lora_B["default"].weight))
        reference = w + (ALPHA / RANK) * b @ a
        assert (b != 0).any()
        torch.testing.assert_close(lora.merged_weight(module).double(), reference, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            out = module(x)
        bias = module.base_layer.bias
        expect = x.double() @ reference.t() + (0 if bias is None else bias.double())
        torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_initial_adapters_depend_on_the_seed_only():
    _, one, _ = adapted()
    _, two, _ = adapted()
    _, other, _ = adapted(seed=SEED + 1)
    first, second = lora.initial_state(one, SEED), lora.initial_state(two, SEED)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(first[k], one.state_dict()[k]) for k in first)  # attach loaded them
    a_keys = [k for k in first if ".lora_A." in k]
    assert not any(torch.equal(first[k], lora.initial_state(other, SEED + 1)[k]) for k in a_keys)
    assert len({first[k].sum().item() for k in a_keys}) == len(a_keys)  # every layer its own draw


def test_a_checkpoint_loads_into_an_adapted_model_on_the_meta_device():
    """The math path: adapters put into a model on the meta device, then the plain checkpoint
    (its weights renamed under base_layer, the adapters' start added) loads strictly."""
    plain = tiny_qwen2()
    with torch.device("meta"):
        model = type(plain)(plain.config)
    lora.attach(model, rank=RANK, alpha=ALPHA, seed=SEED)
    model.to_empty(device="cpu")
    state = lora.checkpoint_state(plain.state_dict(), model, SEED)
    model.load_state_dict(state, strict=True)
    _, reference, _ = adapted()
    for key, value in reference.state_dict().items():
        if "rotary" not in key:
            assert torch.equal(model.state_dict()[key], value), key


def test_bad_input_is_refused():
    model = tiny_qwen2()
    with pytest.raises(lora.LoraError, match="exceeds the smallest side"):
        lora.attach(model, rank=1000, alpha=ALPHA, seed=SEED)
    with pytest.raises(lora.LoraError, match="rank > 0"):
        lora.attach(model, rank=0, alpha=ALPHA, seed=SEED)
    with pytest.raises(lora.LoraError, match="no module named"):
        lora.attach(model, rank=RANK, alpha=ALPHA, seed=SEED, targets=("nothing",))
    assert not lora.layers(model)  # nothing was put in


def test_every_family_gets_adapters_on_its_own_targets():
    """Each model family's row of architectures.py names the targets, Phi-3's fused ones
    included: the adapters go exactly there."""
    from infra import architectures
    import tiny_families

    for model_type in sorted(architectures.ARCHITECTURES):
        model = tiny_families.model(model_type)
        lora.attach(model, rank=4, alpha=ALPHA, seed=SEED)
        adapted = {n.rsplit(".", 1)[-1] for n in lora.layers(model)}
        assert adapted == set(architectures.lookup(model_type).targets), model_type

"""architectures.py: every family in the table, built from a tiny local config, trains with LoGRA
and its engine follows it bit for bit, in the Hugging Face layout and in vLLM's fused one (a
stand-in with vLLM's names and row order, written from vLLM's model files independently of the
table); a family or a layer the table does not cover stops
with one line. A real vLLM CPU engine for the fused Phi-3: test_vllm_engine.py; every family through
vLLM's CPU build: bench/architectures.py."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import rowadam
import sketch
import sync
from infra import architectures, wire
from infra.engine_weights import StreamedEngineWeights
from infra.architectures import ArchitectureError
import in_process
import tiny_families

SEED, RANK = 3, 8
VOCAB = tiny_families.VOCAB


FAMILIES = sorted(architectures.ARCHITECTURES)


def test_the_table_and_the_modules_agree():
    assert set(architectures.TARGET_NAMES) == set(sketch.TARGETS)
    for model_type, arch in architectures.ARCHITECTURES.items():  # every target reaches the engine, once
        held = [t for parts in arch.engine.values() for t in parts]
        assert sorted(held) == sorted(arch.targets), model_type
        assert set(arch.engine) == set(tiny_families.VLLM_ROWS), model_type  # vLLM's layer names


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_trains_and_its_engines_follow(model_type, tied):
    model = tiny_families.model(model_type, tied)
    arch = architectures.check_layers(model)
    found = sketch.target_modules(model)
    per_layer = {n.rsplit(".", 1)[-1] for n in found}
    assert per_layer == set(arch.targets) and len(found) == 2 * len(arch.targets)
    with torch.no_grad():
        for m in found.values():
            rowadam.avoid_bf16_ties_(m.weight)
    engine_model = copy.deepcopy(model).to(torch.bfloat16)
    fused = tiny_families.vllm_layout(engine_model)
    layers = sketch.attach(model, rank=RANK, seed=SEED)
    opt = rowadam.RowAdam(layers, seed=SEED, update_ratio=1e-3)
    engines = [sync.EngineWeights(engine_model, base_seed=SEED, rank=RANK),
               StreamedEngineWeights(fused, base_seed=SEED, rank=RANK, layout="vllm", engine_layers=arch.engine)]
    start = sync.full_payload({l.name: l.module.weight.detach() for l in layers}, update=0, base_seed=SEED,
                              rank=RANK, dtype=torch.float32)
    for e in engines:
        assert set(e.slots) == {l.name for l in layers}
        e.load_full(start)
    base = {l.name: l.module.weight.detach().clone() for l in layers}
    g = torch.Generator().manual_seed(7)
    for update in range(3):
        ids = torch.randint(3, VOCAB, (4, 9), generator=g)
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        assert all(l.sketch.abs().sum() > 0 for l in layers)  # every target's sketch got a gradient
        opt.prepare()
        factors = opt.merge(1.0)
        payload = wire.decode(wire.encode(sync.Payload(update, SEED, RANK, {l.name: f for l, f in
                                                                             zip(layers, factors)})))
        for e in engines:
            e.apply(payload)
            sync.check_fingerprints(sync.fingerprint(layers), e.fingerprint())  # after every factor sync
    assert all(not torch.equal(l.module.weight, base[l.name]) for l in layers)  # all kinds of projection moved
    # Each vLLM layer's rows are its parts' bf16 masters in vLLM's own order (VLLM_ROWS, written
    # from vLLM's files): a row of the table with the parts in another order would fail here,
    # where the fingerprints (read through the same row) would not.
    masters = {l.name: l.module.weight.detach().to(torch.bfloat16) for l in layers}
    for name, module in fused.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in tiny_families.VLLM_ROWS:
            prefix = name[: -len(last)]
            parts = (last,) if prefix + last in masters else tiny_families.VLLM_ROWS[last]
            assert torch.equal(module.weight, torch.cat([masters[prefix + p] for p in parts])), name
    # The bf16 engine's log-probs against the fp32 trainer's on the same tokens.
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (4, 9), generator=g)
        ref = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
        got = torch.log_softmax(engine_model(input_ids=ids).logits.double(), -1)
    gap = (ref - got).abs()
    assert gap.mean() < 2e-2 and gap.max() < 0.25, (gap.mean().item(), gap.max().item())


def test_a_layer_without_its_targets_stops_with_the_layers_it_has():
    model = tiny_families.model("llama")
    del architectures.decoder_layers(model)[1].mlp.up_proj
    with pytest.raises(ArchitectureError) as err:
        architectures.check_layers(model)
    message = str(err.value)
    assert "decoder layer 1 has no nn.Linear up_proj" in message and "down_proj, gate_proj, k_proj" in message
    assert "\n" not in message


def test_a_family_without_a_row_is_refused_before_anything_loads(tmp_path):
    """GPT-2 (no row): train.py stops with one line and exit code 2, no traceback."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    out = in_process.run(["--model", "tiny-math", "--model-path", str(folder), "--train-data", "t.jsonl", "--eval-data",
                          "e.jsonl", "--run-dir", str(tmp_path / "run")], check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "model_type 'gpt2' is not in the architecture table" in out.stderr and "phi3" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_probe_sees_the_logits_the_model_gives(model_type):
    """KL1 from the fast probe (infra/probe_decoder.py: decoder, then the head on the scored
    positions) equals KL1 from the whole model's forward with the tangent (kl_control.probe_logits,
    the reference probe's), for every family: also
    Gemma 2, whose forward caps the logits (cap tanh(z / cap)) after the head. The head is
    scaled so that logits reach the cap's range, where a probe without it would be far off."""
    import kl_control
    from infra.probe_decoder import fast_probe

    model = tiny_families.model(model_type, tied=model_type == "gemma2")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(60.0)
    layers = sketch.attach(model, rank=RANK, seed=SEED)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt = rowadam.RowAdam(layers, seed=SEED, update_ratio=1e-2)
    opt.prepare()
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    kl1 = fast_probe(model, layers, opt.directions, ids, mask).kl1
    z, u = kl_control.probe_logits(model, layers, opt.directions, ids)  # the model's own forward
    scored = mask[:, 1:].bool()
    whole = kl_control.token_kl(z[:, :-1][scored], u[:, :-1][scored], 1.0).mean().item()
    assert z.abs().max() > 10  # logits in the range where Gemma 2's cap (30) bends them
    assert abs(kl1 - whole) <= 1e-4 * whole, (kl1, whole)

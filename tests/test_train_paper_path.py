"""train.py's paper path, its CPU-testable parts: presets and --dry-run (in this process), the
probe's sample size, and the sharded checkpoint load on 2 ranks (the slow tier; the engine
processes: test_vllm_engine.py; the memory plan: test_memory_plan.py)."""

import json

import pytest
import torch

import in_process
import kl_control
import train
from infra import memory_plan, planning, policy
from infra.errors import RunError
from distributed import run_gloo
from tiny import tiny_qwen2


def dry(*args):
    """train.py --dry-run ARGS, in this process."""
    return in_process.run(["--dry-run", *args], check=False)


# Parameter counts published with the checkpoints (an independent reference for the configs);
# 27b is the configuration this project assumes (Qwen2.5-32B widths, 52 layers).
@pytest.mark.parametrize("preset, billions", [("1.5b", 1.54), ("7b", 7.62), ("27b", 26.91)])
def test_dry_run_presets(preset, billions):
    out = dry("--model", preset)
    assert out.returncode == 0, out.stderr
    assert f"preset {preset}: {billions:.2f}B parameters" in out.stdout
    assert "FSDP2 over 4 training ranks" in out.stdout and "vLLM engines on GPUs 4,5,6,7" in out.stdout
    assert f"launch: torchrun --nproc_per_node 4 train.py --model {preset}" in out.stdout
    m = memory_plan.estimate(train.PRESETS[preset].model, 4, 256)
    assert abs(m["params"] / 1e9 - billions) < 0.005
    # AdamW: fp32 gradient + 2 moments per target weight, sharded 4 ways.
    assert m["adam_grads"] == 4 * -(-m["target_params"] // 4) and m["adam_moments"] == 2 * m["adam_grads"]


def test_dry_run_json_keys():
    out = dry("--model", "7b", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    for key in ("trainer_adam_bytes", "trainer_logra_bytes", "trainer_activation_bytes", "engine_gpu_bytes",
                "engine_kv_cache_bytes", "engine_host_bytes"):
        assert isinstance(plan[key], int) and plan[key] >= 0, key
    assert plan["preset"] == "7b" and plan["trainer_logra_bytes"] < plan["trainer_adam_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--model", "7b", "--engine-gpus", "0,1,2,3"], "engines need other GPUs"),
    (["--model", "7b", "--engine-gpus", "4,5,6"], "does not split across 3 ranks"),  # a rank per engine GPU
    (["--model", "7b", "--engine-gpus", "4,4,5,6"], "must name 4 distinct GPUs"),
    (["--model", "7b", "--batch", "126"], "does not split across 4 ranks"),
])
def test_dry_run_rejects_bad_assignments(args, message):
    out = dry(*args)
    assert out.returncode == 2 and message in out.stderr


def test_dry_run_plans_several_nodes():
    """--nodes 2: FSDP2 over 8 ranks (the plan per GPU shrinks), 4 ranks and 4 engines per node,
    and the launch lines for every node and for Slurm."""
    two = dry("--model", "7b", "--nodes", "2")
    assert two.returncode == 0, two.stderr
    assert "FSDP2 over 8 training ranks" in two.stdout
    assert "layout: 2 nodes x 4 training ranks; on each node, training ranks on GPUs 0..3" in two.stdout
    launch_lines = [line for line in two.stdout.splitlines() if line.startswith("launch: ")]
    assert launch_lines[0].startswith("launch: on each of the 2 nodes: torchrun --nnodes 2 --nproc_per_node 4 "
                                      "--rdzv-backend c10d --rdzv-endpoint")
    assert launch_lines[1].startswith("launch: under Slurm: HEAD=$(scontrol show hostnames")
    assert all(line.endswith("--run-dir /shared/runs/NAME") for line in launch_lines)
    plan = json.loads(dry("--model", "7b", "--nodes", "2", "--json").stdout)
    assert plan["world"] == 8 and plan["layout"] == {"nodes": 2, "ranks_per_node": 4, "world": 8,
                                                     "engine_gpus": [4, 5, 6, 7]}
    one_node = memory_plan.estimate(train.PRESETS["7b"].model, 4, 256)
    assert plan["weights"] < one_node["weights"]  # each rank holds an eighth of the weights, not a quarter
    with pytest.raises(RunError) as stop:
        planning.configure(["--nodes", "2"], train.PRESETS)
    assert stop.value.exit_code == 2 and "--nodes 2: a number >= 1, with --dry-run" in str(stop.value)


def test_27b_needs_a_model_path(tmp_path):
    out = in_process.run(["--model", "27b", "--run-dir", str(tmp_path / "r")], check=False, WORLD_SIZE="4")
    assert out.returncode == 2 and "--model-path" in out.stderr and not (tmp_path / "r").exists()


def _sharded_load(rank, world, path, out):
    model = policy.load_pretrained_sharded(path, "logra", torch.device("cpu"), world, rank)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if rank == 0:
        torch.save(logits, out)


@pytest.mark.slow
def test_meta_init_sharded_load_matches_the_checkpoint(tmp_path):
    ref = tiny_qwen2()
    ref.save_pretrained(tmp_path / "ckpt")
    run_gloo(_sharded_load, 2, str(tmp_path / "ckpt"), str(tmp_path / "logits.pt"))
    with torch.no_grad():
        expect = ref(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])).logits
    got = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_probe_count_sizes_the_probe_in_tokens():
    mask = torch.zeros(6, 10, dtype=torch.bool)
    for i, n in enumerate([3, 4, 2, 5, 1, 1]):  # generated tokens of each response
        mask[i, 10 - n:] = True
    assert kl_control.probe_count(mask, 2, 0) == 2  # the paper's rule: 2 responses
    assert kl_control.probe_count(mask, 2, 7) == 2  # 3 + 4 tokens suffice
    assert kl_control.probe_count(mask, 2, 8) == 3  # one more response
    assert kl_control.probe_count(mask, 1, 14) == 4  # 3 + 4 + 2 + 5
    assert kl_control.probe_count(mask, 2, 1000) == 6  # all of them, never more
    assert kl_control.probe_count(mask[:1], 2, 0) == 1


def test_small_instruct_preset_matches_its_family():
    """smollm2-135m's widths build a Llama (its row in architectures.py) whose parameter count
    the memory plan reproduces, and it passes the dry run's checks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from infra import architectures

    widths = train.PRESETS["smollm2-135m"].model
    config = AutoConfig.for_model(**widths)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    architectures.check_layers(model)
    count = sum(p.numel() for p in model.parameters())
    assert 0.13e9 < count < 0.14e9  # "135M"
    assert memory_plan.estimate(widths, 1, 64)["params"] == count
    out = dry("--model", "smollm2-135m")
    assert out.returncode == 0 and "preset smollm2-135m: 0.13B parameters" in out.stdout, out.stderr

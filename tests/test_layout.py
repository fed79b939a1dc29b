"""The layout: no module imports train.py, the imports have no cycle, the algorithm files need
at most sketch.py; and each infrastructure module (tasks, checkpoint, launch, architectures,
options, memory_plan, metrics) runs one of its functions in a fresh interpreter, copied with only the project
modules it imports into an empty folder, without train.py and without a process group."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

from subproc import ROOT, env

MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def project_imports(name: str) -> set[str]:
    """The project modules `name`.py imports, at any depth of the file (lazy imports included)."""
    tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(MODULES) - {name}


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in project_imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_module_imports_train_and_no_cycle():
    assert {"train", "sketch", "rowadam", "kl_control", "ppo", "sync", "engine", "tasks", "checkpoint", "launch",
            "architectures", "options", "memory_plan", "metrics", "heal", "lora"} <= set(MODULES)
    for name in MODULES:
        assert "train" not in closure(name) or name == "train", name
        assert name not in closure(name), f"{name} imports itself through {sorted(closure(name))}"
    # The algorithm files copy alone: torch, the standard library and at most sketch.py.
    for name in ("sketch", "rowadam", "kl_control", "ppo"):
        assert closure(name) <= {"sketch"}, (name, closure(name))
    for name in ("tasks", "checkpoint", "launch", "architectures", "metrics", "lora"):  # leaves
        assert closure(name) == set(), (name, closure(name))


# One call of each module's own, run where nothing else of the project exists.
CALLS = {
    "tasks": "t = tasks.Arithmetic(0, 16); assert t.decode(t.encode('12+30=\\\\boxed{42}')) == '12+30=\\\\boxed{42}'",
    "checkpoint": ("import torch, tempfile; d = tempfile.mkdtemp(); "
                   "checkpoint.save(d, {'w': torch.arange(4.0)}, 3, rank=0, world=1); "
                   "p = checkpoint.resume_path(d, None, rank=0, world=1); s = {'w': torch.zeros(4)}; "
                   "checkpoint.load(p, s); assert s['w'].tolist() == [0, 1, 2, 3] and p.endswith('checkpoint-3')"),
    "architectures": ("a = architectures.check_config({'model_type': 'phi3'}); assert 'qkv_proj' in a.targets; "
                      "import pytest; pytest.raises(architectures.ArchitectureError, architectures.lookup, 'gpt2')"),
    "launch": ("l = launch.Layout.from_env({'WORLD_SIZE': '8', 'LOCAL_WORLD_SIZE': '4'}, '4,5,6,7'); "
               "launch.check(l, 8); launch.check_shared_folder('.'); assert l.engine_gpu(1) == 5 and l.nodes == 2"),
    "options": ("a = options.parse(['--rank', '4'], {'tiny': {}}); assert a.sketch_rank == 4 and a.model == 'tiny'"),
    "memory_plan": ("p = memory_plan.estimate(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
                    "num_attention_heads=2, num_key_value_heads=1, vocab_size=32), 1, 8); "  # v: one per target row
                    "assert p['logra_moments'] == 4 * 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)"),
    "heal": ("from engine import EngineLost\n"
             "class E:\n    n = 0\n"
             "    def generate(self, x):\n        E.n += 1\n"
             "        if E.n == 1: raise EngineLost('gone')\n        return x\n"
             "    def close(self): pass\n"
             "s = heal.Supervisor(E, restarts=1, log=print); assert s.generate(7) == 7 and s.restarts == 1"),
    "lora": ("from transformers import Qwen2Config, Qwen2ForCausalLM; m = Qwen2ForCausalLM(Qwen2Config("
             "hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, "
             "vocab_size=16)); p = lora.attach(m, rank=4, alpha=8.0, seed=0); "
             "assert len(p) == 14 and len(lora.layers(m)) == 7"),
    "metrics": ("assert metrics.summary([{'update': 0, 'pass1': 0.25}, {'update': 1, 'pass1': 0.5}], heldout=4, "
                "engine='hf')[0].endswith('+25.0 points, 4 problems)')"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_module_runs_alone(name, tmp_path):
    for module in {name} | closure(name):
        shutil.copy(os.path.join(ROOT, f"{module}.py"), tmp_path)
    check = (f"import sys, {name}; {CALLS[name]}; import torch.distributed as dist; "
             f"assert 'train' not in sys.modules and not dist.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env(PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr

"""The layout: the top level is the design card (the method files, train.py, tests/, bench/,
examples/, and the one folder infra/ of everything that runs the method); no method file
imports infra/, nothing imports train.py, the imports have no cycle, the method files copy
alone (torch, the standard library, at most sketch.py); and each infrastructure file imports,
and runs one of its functions, in a fresh interpreter that holds only it and the project
files it imports, without train.py and without a process group."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys

from subproc import ROOT, env

METHOD = ("sketch", "rowadam", "kl_control", "sync", "ppo")
CARD = {"pyproject.toml", "README.md", *(f"{m}.py" for m in METHOD), "train.py", "tests", "bench", "examples",
        "infra"}
INFRA = sorted(f"infra.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "infra"))
               if f.endswith(".py") and f != "__init__.py")
MODULES = set(METHOD) | {"train"} | set(INFRA)


def path_of(name: str) -> str:
    return os.path.join(ROOT, *name.split(".")) + ".py"


def project_imports(name: str) -> set[str]:
    """The project modules `name` imports, at any depth of the file (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(open(path_of(name)).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # from infra import launch
    return found & MODULES - {name}


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in project_imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_top_level_is_the_design_card():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/")[0] for path in tracked} - {".ci", ".gitignore"}
    assert top <= CARD and CARD - {"examples"} <= top, sorted(top ^ CARD)
    assert not [p for p in tracked if p.endswith(".py") and "/" not in p and p[:-3] not in (*METHOD, "train")]


def test_no_method_file_imports_the_infrastructure_and_nothing_imports_train():
    for name in sorted(MODULES):
        assert "train" not in closure(name) or name == "train", name
        assert name not in closure(name), f"{name} imports itself through {sorted(closure(name))}"
    for name in METHOD:  # the method copies without infra/
        assert not {m for m in closure(name) if m.startswith("infra.")}, (name, closure(name))
    for name in ("sketch", "rowadam", "kl_control", "ppo"):  # torch, the standard library, at most sketch.py
        assert closure(name) <= {"sketch"}, (name, closure(name))
        # Their docstrings' use blocks too: they show the method files together (kl_control.py's
        # the whole update: sketch, rowadam, ppo), never the infrastructure or train.py.
        tree = ast.parse(open(path_of(name)).read())
        docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
        shown = {m for doc in docs for m in re.findall(r"^\s+(?:import|from) ([\w.]+)", doc, re.M)}
        assert shown & MODULES <= set(METHOD) and not {m for m in shown if m.split(".")[0] in ("infra", "train")}, \
            (name, shown)
    for name in ("infra.errors", "infra.architectures", "infra.metrics", "infra.tasks", "infra.launch", "infra.lora"):
        assert closure(name) <= {"infra.errors"}, (name, closure(name))  # leaves: they raise their own RunError


# One call of each infrastructure file's own, run where nothing else of the project exists.
CALLS = {
    "infra.errors": "e = errors.RunError('x'); assert e.exit_code == 2 and e.line() == 'train.py: error: x'",
    "infra.tasks": ("t = tasks.Arithmetic(0, 16); "
                    "assert t.decode(t.encode('12+30=\\\\boxed{42}')) == '12+30=\\\\boxed{42}'"),
    "infra.checkpoint": ("import torch, tempfile; d = tempfile.mkdtemp(); "
                         "checkpoint.save(d, {'w': torch.arange(4.0)}, 3, rank=0, world=1); "
                         "p = checkpoint.resume_path(d, None, rank=0, world=1); s = {'w': torch.zeros(4)}; "
                         "checkpoint.load(p, s); "
                         "assert s['w'].tolist() == [0, 1, 2, 3] and p.endswith('checkpoint-3')"),
    "infra.architectures": ("a = architectures.check_config({'model_type': 'phi3'}); assert 'qkv_proj' in a.targets; "
                            "import pytest; pytest.raises(architectures.ArchitectureError, architectures.lookup, 'gpt2')"),
    "infra.launch": ("l = launch.Layout.from_env({'WORLD_SIZE': '8', 'LOCAL_WORLD_SIZE': '4'}, '4,5,6,7'); "
                     "launch.check(l, 8); launch.check_shared_folder('.'); assert l.engine_gpu(1) == 5 and l.nodes == 2"),
    "infra.options": ("flags, given = options.parse(['--rank', '4'], {'tiny': None}); "
                      "assert given == {'sketch_rank': 4} and flags.model == 'tiny' and options.flag('sketch_rank') == '--rank'"),
    "infra.planning": ("import dataclasses; from infra.options import Config; "
                       "c = Config(preset='tiny', task='arithmetic', model=dict(hidden_size=64, intermediate_size=128, "
                       "num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1), sketch_rank=8, batch=8, "
                       "micro_batch=8, updates=1, update_ratio=1e-3, kl_start=1e-2, kl_end=1e-3, kl_horizon=10, "
                       "adam_lr=1e-4, lora_lr=1e-3, max_new_tokens=4, context=16, checkpointing=False, "
                       "eval_temperature=1.0, eval_top_p=1.0, eval_every=0, eval_problems=8, eval_samples=1, "
                       "save_every=0, device='cpu', engine='hf', engine_timeout=60, dist_timeout=200); "
                       "c.check(1, c); assert planning.run_plan(c, 1)['layers'] == 2"),
    "infra.engine_sync": ("assert engine_sync.exact('logra', 'factors') and not engine_sync.exact('adam', 'delta')"),
    "infra.memory_plan": ("p = memory_plan.estimate(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
                          "num_attention_heads=2, num_key_value_heads=1, vocab_size=32), 1, 8); "  # v: one per target row
                          "assert p['logra_moments'] == 4 * 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)"),
    "infra.heal": ("from infra.engine import EngineLost\n"
                   "class E:\n    n = 0\n"
                   "    def generate(self, x):\n        E.n += 1\n"
                   "        if E.n == 1: raise EngineLost('gone')\n        return x\n"
                   "    def close(self): pass\n"
                   "s = heal.Supervisor(E, restarts=1, log=lambda line: None); assert s.generate(7) == 7 and s.restarts == 1"),
    "infra.lora": ("from transformers import Qwen2Config, Qwen2ForCausalLM; m = Qwen2ForCausalLM(Qwen2Config("
                   "hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, "
                   "num_key_value_heads=1, vocab_size=16)); p = lora.attach(m, rank=4, alpha=8.0, seed=0); "
                   "assert len(p) == 14 and len(lora.layers(m)) == 7"),
    "infra.metrics": ("assert metrics.summary([{'update': 0, 'pass1': 0.25}, {'update': 1, 'pass1': 0.5}], "
                      "heldout=4, engine='hf')[0].endswith('+25.0 points, 4 problems)')"),
    "infra.policy": ("m = policy.build_model(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
                     "num_attention_heads=2, num_key_value_heads=1), 20, 0); "
                     "opt, layers = policy.make_optimizer(m, 'logra', sketch_rank=4, seed=0, update_ratio=1e-3, "
                     "adam_lr=1e-4, lora_lr=1e-3, checkpointing=False); assert len(layers) == 7"),
    "infra.engine": ("import torch; from transformers import Qwen2Config, Qwen2ForCausalLM; torch.manual_seed(0); "
                     "m = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
                     "num_attention_heads=2, num_key_value_heads=1, vocab_size=16)).to(torch.bfloat16); "
                     "e = engine.HFEngine(m, base_seed=0, sketch_rank=4, eos=2, pad=0); "
                     "r = e.generate([[1, 5, 6]], [7], temperature=1.0, max_new_tokens=3); "
                     "assert r.ids.shape[0] == 1 and r.mask[:, :3].sum() == 0"),
    "infra.vllm_engine": ("import sys; env = vllm_engine.engine_env(None, {'HOME': '/root', 'RANK': '3'}); "
                          "assert 'RANK' not in env and 'vllm' not in sys.modules"),
    "infra.vllm_channel": ("import sys; s = vllm_channel.WeightChannel.open_store(vllm_channel.LOCAL_HOST, 5); "
                           "assert s.port > 0 and 'vllm' not in sys.modules"),
    "infra.vllm_serve": ("import sys; assert all(hasattr(vllm_serve.WorkerExtension, 'logra_' + c) for c in "
                         "('init', 'apply', 'load_full', 'fingerprint')) and 'vllm' not in sys.modules"),
    "infra.task_data": ("import tempfile, os; d = tempfile.mkdtemp(); p = os.path.join(d, 'm.jsonl'); "
                        "open(p, 'w').write('{\"problem\": \"What is $1+1$?\", \"answer\": \"2\"}\\n'); "
                        "assert task_data.read_rows(p, 'evaluation data', '--eval-data', task_data.math500_row) == "
                        "[('What is $1+1$?', '2')]"),
    "infra.lifecycle": "assert lifecycle.Run.stop_if_signalled.__doc__",
    "infra.run_dir": ("import os, tempfile; d = os.path.join(tempfile.mkdtemp(), 'run'); h = run_dir.hold(d); "
                      "assert os.path.exists(os.path.join(d, 'run.lock')) and not run_dir.inspect({}, d).continues; "
                      "h.release(undo=True); assert not os.path.exists(d)"),
}


def test_every_infrastructure_file_has_a_call():
    assert sorted(CALLS) == INFRA


# One interpreter for every file (torch imported once): each file's folder holds only it and
# the project files it imports, and the project's modules are dropped before the next file.
ALONE = """
import json, sys
calls = json.loads(sys.argv[1])
for name, (folder, call) in calls.items():
    for m in [m for m in sys.modules if m in {PROJECT} or m == "infra" or m.startswith("infra.")]:
        del sys.modules[m]
    sys.path.insert(0, folder)
    exec(f"from infra import {{name.split('.')[-1]}}\\n{{call}}", {{}})
    sys.path.remove(folder)
    import torch.distributed as dist
    assert "train" not in sys.modules and not dist.is_initialized(), name
    print("ok", name)
"""


def test_each_infrastructure_file_runs_alone(tmp_path):
    calls = {}
    for name in INFRA:
        folder = tmp_path / name
        os.makedirs(folder / "infra")
        for module in {name} | closure(name):
            shutil.copy(path_of(module), folder / os.path.relpath(path_of(module), ROOT))
        calls[name] = (str(folder), CALLS[name])
    script = ALONE.format(PROJECT=set(METHOD) | {"train"})
    out = subprocess.run([sys.executable, "-c", script, json.dumps(calls)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env(PYTHONPATH=""))
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("ok ")] == [f"ok {n}" for n in INFRA], out.stdout

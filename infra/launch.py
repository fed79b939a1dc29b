"""
infra/launch.py: where a run's processes go (nodes, training ranks, engine GPUs), the process group
that joins them, and refusals that every rank agrees on.

A run on several nodes is the same command on every node, as for any FSDP2 trainer:

    torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        --rdzv-id RUN train.py --model 7b --model-path ... --run-dir /shared/runs/7b

The layout
----------
N nodes x L training ranks (torchrun's WORLD_SIZE = N L and LOCAL_WORLD_SIZE = L). On every
node the training ranks take GPUs 0..L-1 and their rollout engines take the node's
`engine_gpus` (one per local rank, the same list on every node): local rank i's engine runs on
GPU engine_gpus[i] of its own node. The weight channel between a trainer and its engine is
therefore always on the loopback interface; only the trainers' FSDP2 collectives cross nodes.
`Layout` holds it, `agreed_layout` reads it from torchrun's variables on every rank, `check`
refuses a layout that a node's GPUs cannot hold, and `commands` writes the launch lines (torchrun, Slurm).

Agreement
---------
A rank that stops on its own while another waits in a collective leaves that one waiting until
the process group's timeout. So everything that may differ between ranks (what a node has: its
GPUs, its files) is checked after the process group starts, and the verdict is gathered:
`agree(error)` raises the first rank's error on every rank, `agreed(fn)` runs a check that way,
and `agreed_layout` reads the layout so (nodes must run the same number of ranks).
Checks that depend only on the command line need no agreement: every rank reaches the same
verdict before the group exists.

The run directory
-----------------
Rank 0 alone writes the run's config, the engine's model copy, each checkpoint's index and
manifest, and the pointer to the newest checkpoint, which the other ranks then read: the run
directory must be one folder that every node mounts (NFS, Lustre, ...). `check_shared_folder`
proves it before anything is written: each rank writes a probe file, every rank looks for all
of them, and a rank that misses one stops every rank with one line.

Preemption and restarts
-----------------------
A scheduler stops a job with SIGTERM and kills it a grace period later; torchrun forwards
SIGTERM and SIGINT to every rank. `Preemption` turns the first such signal into a flag that
the ranks check together (`agreed()`, at the same points of every update, one all_reduce), so
that every rank stops at the same update; a second SIGINT (Ctrl-C, a second or more after the
first) stops the process at once. During the set-up (a warm-up, an engine's start), where
nothing is trained yet, the first signal stops the process within a second, nothing to save.
Once a stop has begun, further signals are ignored: the exit status stays 75.
`REQUEUE_EXIT` (75, EX_TEMPFAIL of sysexits.h: "try again later") is the status of a run that
stopped so, with its state saved: run the same command again (a wrapper, or Slurm's
`--requeue`). torchrun gives its ranks `--shutdown-timeout` seconds (default 30) after
forwarding the signal before it kills them; the stop needs about one update and one
checkpoint save.

Departures, numbered
--------------------
1. On GPUs the process group has two backends, "cpu:gloo,cuda:nccl": NCCL for the trainers'
   tensors, gloo for the agreement on refusals and other CPU objects. The NCCL communicator is
   made at the first GPU collective, after the nodes' GPUs were checked and agreed on, so a
   node with too few GPUs is refused on every node instead of failing in NCCL's set-up.
2. The process group's timeout (torch's default: 10 minutes for NCCL) is the caller's, and
   must be longer than the engine's start-up bound: every rank waits in a collective while the
   slowest rank's engine starts.
"""

import dataclasses
import datetime
import os
import pickle
import secrets
import signal
import socket
import threading
import time

import torch.distributed as dist

from infra.errors import RunError, os_advice, os_cause

# How long a rank looks for the others' probe files before it calls the folder unshared; a
# shared file system slower than that to show another node's file sets LOGRA_PROBE_WAIT_S.
PROBE_WAIT_S = float(os.environ.get("LOGRA_PROBE_WAIT_S", "10"))
REQUEUE_EXIT = 75  # EX_TEMPFAIL: stopped on a signal with a checkpoint saved; run the same command again


class LaunchError(RunError):
    """A layout or a launch that cannot run; the message is one line that says what to change."""


# -----------------------------------------------------------------------------
# The layout

@dataclasses.dataclass(frozen=True)
class Layout:
    """`nodes` x `ranks_per_node` training ranks; `engine_gpus[i]`: the GPU of local rank i's
    engine on its own node (empty: no engine on a GPU)."""

    nodes: int
    ranks_per_node: int
    engine_gpus: tuple = ()

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @classmethod
    def from_env(cls, environ, engine_gpus: str = None) -> "Layout":
        """The layout torchrun started: WORLD_SIZE and LOCAL_WORLD_SIZE (a run without torchrun
        is 1 x 1; WORLD_SIZE without LOCAL_WORLD_SIZE is one node)."""
        world = int(environ.get("WORLD_SIZE", "1"))
        local = int(environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise LaunchError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}: every node must "
                              f"run the same number of training ranks (torchrun --nproc_per_node)")
        return cls(world // local, local, parse_gpus(engine_gpus))

    def engine_gpu(self, local_rank: int):
        """The GPU index, on this node, of local rank `local_rank`'s engine (None: no GPU engine)."""
        return self.engine_gpus[local_rank] if self.engine_gpus else None

    def record(self) -> dict:
        """What config.json and each checkpoint's manifest record of the layout."""
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "world": self.world,
                "engine_gpus": list(self.engine_gpus)}

    def describe(self) -> str:
        plural = lambda n, word: f"{n} {word}{'s' if n > 1 else ''}"  # noqa: E731
        text = f"{plural(self.nodes, 'node')} x {plural(self.ranks_per_node, 'training rank')}"
        if self.engine_gpus:
            text += (f"; on each node, training ranks on GPUs 0..{self.ranks_per_node - 1} and their vLLM engines on "
                     f"GPUs {','.join(map(str, self.engine_gpus))} (local rank i's on the i-th)")
        return text


def layout_change(manifest, layout: Layout) -> str:
    """The layout a checkpoint's manifest records, beside this run's; "" when they are the same."""
    saved = (manifest or {}).get("layout")
    if saved is None or saved == layout.record():
        return ""
    return (f"written by {Layout(saved['nodes'], saved['ranks_per_node'], tuple(saved['engine_gpus'])).describe()},"
            f" now {layout.describe()}")


def parse_gpus(text) -> tuple:
    """`--engine-gpus 4,5,6,7` as (4, 5, 6, 7); None or "" as ()."""
    items = [g.strip() for g in (text or "").split(",") if g.strip()]
    if not all(g.isdigit() for g in items):
        raise LaunchError(f"--engine-gpus {text}: give GPU indices separated by commas, e.g. --engine-gpus 4,5,6,7")
    return tuple(int(g) for g in items)


def check(layout: Layout, gpus_per_node=None):
    """Refuse a layout that a node with `gpus_per_node` GPUs cannot hold (None: a CPU run, no
    GPU to count). The engines need their own GPUs, one per training rank of the node."""
    local, engines = layout.ranks_per_node, layout.engine_gpus
    listed = ",".join(map(str, engines))
    if engines and (len(engines) != local or len(set(engines)) != local):
        raise LaunchError(f"--engine-gpus {listed} must name {local} distinct GPUs, one per training rank of a node "
                          f"({layout.describe()})")
    if gpus_per_node is not None and gpus_per_node < local + len(engines):
        raise LaunchError(f"{socket.gethostname()} has {gpus_per_node} GPUs (torch.cuda.device_count()) and this "
                          f"run needs {local + len(engines)} on each node ({layout.describe()})")
    if engines and (min(engines) < local or (gpus_per_node is not None and max(engines) >= gpus_per_node)):
        among = "" if gpus_per_node is None else f" among 0..{gpus_per_node - 1}"
        raise LaunchError(f"--engine-gpus {listed}: a node's training ranks use GPUs 0..{local - 1}; engines need "
                          f"other GPUs{among}")


def commands(args: str, layout: Layout, *, endpoint: str = "HEAD_NODE:29500") -> list[str]:
    """How to start `train.py args` in `layout`: one line, or (several nodes) the torchrun line
    to run on every node and the same under Slurm, with a run directory on shared storage."""
    if layout.world == 1:
        return [f"python train.py {args}"]
    if layout.nodes == 1:
        return [f"torchrun --nproc_per_node {layout.ranks_per_node} train.py {args}"]
    if "--run-dir" not in args and "--resume" not in args:
        args += " --run-dir /shared/runs/NAME"  # every node must see it (check_shared_folder)

    def torchrun(endpoint, run_id):
        return (f"torchrun --nnodes {layout.nodes} --nproc_per_node {layout.ranks_per_node} --rdzv-backend c10d "
                f"--rdzv-endpoint {endpoint} --rdzv-id {run_id} train.py {args}")

    head = 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'  # the first node of the job
    slurm = torchrun('"$HEAD":29500', '"$SLURM_JOB_ID"')
    return [f"on each of the {layout.nodes} nodes: {torchrun(endpoint, 'logra')}",
            f"under Slurm: {head}; srun --nodes {layout.nodes} --ntasks-per-node 1 {slurm}"]


# -----------------------------------------------------------------------------
# The process group, and agreement

def start_processes(*, cuda: bool, world: int, timeout: float):
    """(device, rank) of this process, in torchrun's process group (departures 1 and 2). On GPUs
    always a group, one code path for 1 and N GPUs (a process without torchrun gets its
    variables' defaults), its device LOCAL_RANK; on the CPU gloo, with several ranks only."""
    import torch

    if cuda:
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(k, v)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        usable = torch.cuda.is_available()
        if usable and device.index < torch.cuda.device_count():  # else check() refuses, on every rank
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if usable else "gloo"  # gloo alone: the refusal can still be agreed
    else:
        device, backend = torch.device("cpu"), "gloo"
    if cuda or world > 1:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return device, dist.get_rank() if dist.is_initialized() else 0


def stop_processes():
    """The process group's end, once every rank is done with it: a barrier (no rank tears the
    group down while another still uses it), then destroy_process_group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def release(passes: int = 8) -> None:
    """Free what a finished run left (call it after main() returns), while the interpreter is
    whole: FSDP2's modules, in reference cycles, hold the process group's backends, and gloo's
    threads torn down in the interpreter's finalization can abort a process whose run succeeded.
    A pass can free what the previous pass's finalizers held (rank 0's plotting leaves such
    objects), so collect until a pass finds nothing."""
    import gc

    for _ in range(passes):
        if not gc.collect():
            return


def agree(error=None):
    """Raise on every rank the error of the lowest rank that has one, if any has. Without a
    process group, raise `error` if there is one. Every rank must call it at the same point."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # an error that cannot travel (both ways) is sent as its words
        error = LaunchError(f"{type(error).__name__}: {error}")
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        first.agreed = True  # every rank stops with it: the caller may print it once per node
        raise first


def agreed(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on every rank; if it raises on any rank, every rank raises the
    lowest such rank's error (agree). Returns fn's value."""
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # every error a check can raise must reach every rank
        agree(e)
        raise  # not reached: agree raised
    agree(None)
    return value


def gathered(facts: dict) -> list[dict]:
    """Every rank's `facts` (plain values), on every rank."""
    if not dist.is_initialized():
        return [facts]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, facts)
    return everyone


def check_restarts(environ):
    """torchrun --max-restarts restarts every rank in the store the first ranks used, unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each restart a fresh one: a shared store keeps
    the dead ranks' addresses, and the new ranks' gloo group may try them (connection refused;
    seen on torch 2.13 in about half the restarts; pytorch#135712). Refused up front, since a
    restart is exactly when the run cannot be watched."""
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise LaunchError("torchrun --max-restarts needs a fresh store for each restart: launch with "
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d (the README's "
                          "\"Runs that heal\")")


class Stopped(RunError):
    """A stop on SIGTERM or SIGINT with nothing lost (exit 75): in the set-up, before any
    update of this process (Preemption.check), or on a second Ctrl-C."""

    exit_code = REQUEUE_EXIT
    label = "stopped"


class Preemption:
    """SIGTERM and SIGINT turned into a stop that every rank agrees on (the module docstring,
    "Preemption and restarts"). Made in the main thread; `restore()` puts back the handlers.

    The loop asks `agreed()` at its stop points. Set-up work that can last (a warm-up, an
    engine's start) asks `check(what)`, which stops at once with `Stopped` while `setup` is
    True: nothing has been trained yet, so there is nothing to save. `hold()` makes every
    further signal a no-op: a process that is already stopping keeps its exit status (75)
    whatever arrives during its teardown.

    A second SIGINT to this process, a second or more after its first signal, stops it at once
    (KeyboardInterrupt; train.py exits 75, the newest checkpoint standing): a user's second
    Ctrl-C. Other repeats are ignored: a scheduler may deliver its SIGTERM to a rank directly
    and through torchrun, a terminal's Ctrl-C reaches torchrun and its ranks alike (so a
    second SIGINT within a second is taken for the same one), and a rank that learnt of
    another rank's signal has received none itself."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.received = None  # the first signal's name (or that another rank had one)
        self.setup = True  # before the first update: check() may stop at once
        self._own = None  # when this process received its first signal
        self._held = False
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame):
        if self._held:
            return
        if self._own is None:
            self._own = time.monotonic()
            self.received = signal.Signals(signum).name
        elif signum == signal.SIGINT and time.monotonic() - self._own >= 1.0:
            self._held = True
            raise KeyboardInterrupt("a second SIGINT: stopping at once")

    def check(self, what: str):
        """Stop at once (`Stopped`, exit 75) if a signal has arrived during the set-up."""
        if self.received is not None and self.setup and not self._held:
            self.hold()
            raise Stopped(f"stopped on {self.received} during {what}, before any update: nothing to save; run the "
                          f"same command again to continue (exit {REQUEUE_EXIT})")

    def hold(self):
        """From now on every SIGTERM and SIGINT is ignored: the process is stopping. SIG_IGN
        itself, not a handler that ignores: Python's finalization puts the default action
        back for signals that have a Python handler (a signal then would end the process with
        128 + its number), but leaves an ignored signal ignored."""
        self._held = True
        if threading.current_thread() is threading.main_thread():
            for s in self._previous:
                signal.signal(s, signal.SIG_IGN)

    def agreed(self) -> bool:
        """Whether any rank has received a signal; every rank must call it at the same point."""
        import torch

        flag = torch.tensor([0 if self.received is None else 1])
        if dist.is_initialized():
            if "gloo" not in str(dist.get_backend()):  # NCCL alone (train.py's groups have gloo beside it)
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()) and self.received is None:
            self.received = "a signal to another rank"
        return bool(flag.item())

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def stop_of(e: BaseException) -> RunError:
    """The RunError a run stops on for `e`: `e` itself if it is one; for Preemption's
    KeyboardInterrupt (a second SIGINT) a Stopped (exit 75), every further signal ignored from
    here; for an OSError that no module worded (a write on a full or read-only file system), a
    refusal naming the path and the cause."""
    if isinstance(e, RunError):
        return e
    if isinstance(e, KeyboardInterrupt):
        for s in (signal.SIGINT, signal.SIGTERM):  # stopping: nothing further changes the exit status
            signal.signal(s, signal.SIG_IGN)
        return Stopped(f"a second SIGINT: stopped at once, without a checkpoint of the updates since the newest "
                       f"one; run the same command again to continue from it (exit {REQUEUE_EXIT})")
    return RunError(f"{os_cause(e)}: {os_advice(e)}, then run the same command again")


def agreed_layout(environ, engine_gpus: str = None) -> Layout:
    """The run's layout from torchrun's variables, the same on every rank or refused on every
    rank: torchrun lets nodes run different numbers of ranks (--nproc_per_node), this layout
    does not. Called on every rank once the process group exists."""
    local = environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1"))
    facts = gathered({"host": socket.gethostname(), "local": local})
    if len({f["local"] for f in facts}) > 1:
        per_host = ", ".join(sorted({f"{f['host']} {f['local']}" for f in facts}))
        raise LaunchError(f"every node must run the same number of training ranks (torchrun --nproc_per_node); "
                          f"LOCAL_WORLD_SIZE is {per_host}")
    return Layout.from_env(environ, engine_gpus)  # the same variables everywhere now: the same verdict


def check_shared_folder(path: str, *, option: str = "--run-dir"):
    """Prove that every rank sees one folder at `path`: each writes a probe file and looks for
    everyone's; a rank that misses one stops every rank with one line (raised on every rank).
    The folder is left as it was found (one made for the probe is removed again)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world, host = dist.get_rank(), dist.get_world_size(), socket.gethostname()
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    names = [os.path.join(path, f".shared-probe-{token[0]}-{r}") for r in range(world)]
    made = []  # the folders this rank creates, deepest last: removed again at the end
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    error, facts = None, None
    try:
        try:
            os.makedirs(path, exist_ok=True)
            with open(names[rank], "w") as f:
                f.write(host)
        except OSError as e:
            error = LaunchError(f"{option} {path}: rank {rank} on {host} cannot write there ({e.strerror})")
        agree(error)
        dist.barrier()  # every probe written before any is looked for
        deadline = time.monotonic() + PROBE_WAIT_S
        while True:  # each file looked up by its name: NFS may serve a folder's listing from its cache
            seen = [r for r, name in enumerate(names) if os.path.exists(name)]
            if len(seen) == world or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        facts = gathered({"rank": rank, "host": host, "seen": seen})
    finally:
        if os.path.exists(names[rank]):
            os.remove(names[rank])
        if facts is not None:
            dist.barrier()  # every probe removed before a folder made for them is
        for folder in made:
            try:
                os.rmdir(folder)
            except OSError:  # another rank's, or not empty: left
                pass
        if facts is not None:
            # Every rank's folders removed before any rank goes on: rank 0 next makes the run
            # directory again for its lock, and a slower rank's rmdir of the (again empty) folder
            # would pull it away between its mkdir and the lock file's creation (seen: ENOENT).
            dist.barrier()
    blind = [f for f in facts if len(f["seen"]) < world]  # the same list on every rank
    if blind:
        f = blind[0]
        missing = sorted(set(range(world)) - set(f["seen"]))
        hosts = ",".join(sorted({facts[r]["host"] for r in missing}))
        error = LaunchError(f"{option} {path} is not one folder shared by every node: rank {f['rank']} on {f['host']} "
                            f"does not see the files of rank(s) {','.join(map(str, missing))} on {hosts}; put it on "
                            f"a filesystem that every node mounts (NFS, Lustre, ...)")
        error.agreed = True  # raised on every rank
        raise error

"""
infra/vllm_channel.py: the weight channel between a trainer process and its vLLM engine.

What it is
----------
`WeightChannel` is a two-member group for payload buffers (infra/wire.py's uint8 buffers): the
trainer process is member 0, the engine's vLLM worker member 1, and one `broadcast` (with
`send`/`recv` for a buffer of any length) carries a payload from the first to the second.
NCCL between GPUs (vLLM's `PyNcclCommunicator` over a `StatelessProcessGroup`, imported only
there), gloo between CPU processes (`ProcessGroupGloo` over the same kind of TCP store). Both
members meet at a TCP store that the trainer opens on a free port (`open_store`) and whose
port it sends the engine over the command connection (vllm_engine.py); the engine runs on its
trainer's node, so the rendezvous is on the loopback interface (`LOCAL_HOST`).

Failure
-------
A broadcast to a peer that never takes it would wait for gloo's timeout on a CPU, and for ever
on a GPU, where an NCCL kernel spins until its peer arrives: every broadcast of the trainer's
side takes a `watch()` that raises to give up (its engine died, its deadline passed), and a
broadcast given up on aborts the communicator (on GPUs in a thread with a bound, as vLLM's own
destroy() does); one that cannot be aborted is an EngineError that says to stop the run. A
communicator that vLLM brings up disabled (NCCL could not start: every call then does nothing)
is an EngineError at once, before any broadcast; `close` aborts the trainer's communicator when
its engine is restarted or stopped.
"""

import datetime
import time

import torch
import torch.distributed as dist

from infra.engine import EngineError

# The engine runs on its trainer's node (launch.py, "The layout"): its command socket and the
# weight channel's rendezvous are on the loopback interface, never across nodes.
LOCAL_HOST = "127.0.0.1"


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
            if self.comm.disabled:  # vLLM's communicator then skips every call: each broadcast a silent no-op
                raise EngineError(f"vLLM's NCCL communicator came up disabled on {self.device} (NCCL could not "
                                  f"start there): no weight could be sent; the engine's log says why")
            self.stream = torch.cuda.Stream(self.device)
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

    def broadcast(self, tensor: torch.Tensor, watch=None) -> None:
        """Member 0's tensor into member 1's (same shape and dtype, on this channel's device).

        `watch()` is called while the broadcast is in flight and raises to give up on it (the
        trainer's side: its engine process died or the deadline passed). A broadcast to a peer
        that never joins would otherwise wait for gloo's timeout on a CPU, and for ever on a
        GPU, where an NCCL kernel spins until its peer arrives: there the broadcast runs on the
        channel's own stream, its completion is polled, and a broadcast given up on aborts the
        communicator, which ends the kernel."""
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)  # the tensor is ready
            self.comm.broadcast(tensor, src=0, stream=self.stream)
            tensor.record_stream(self.stream)  # its memory is not reused before the broadcast is done
            done = torch.cuda.Event()
            done.record(self.stream)
            self._wait(done.query, watch)
            current.wait_stream(self.stream)
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            work = self.pg.broadcast([tensor], opts)
            self._wait(work.is_completed, watch)
            work.wait()  # raises if it failed

    def _wait(self, finished, watch):
        pause = 1e-4
        try:
            while watch is not None and not finished():
                watch()
                time.sleep(pause)
                pause = min(2 * pause, 5e-3)
        except BaseException:
            self.abort()
            raise

    def abort(self):
        """Give up the channel: on GPUs, ncclCommAbort ends the kernels waiting for the peer.
        (On CPUs the peer's processes are killed by then, which fails gloo's pending op.)"""
        if self.device.type == "cuda" and not self.comm.disabled:
            import threading

            def abort():
                with torch.cuda.device(self.device):
                    self.comm.nccl.ncclCommAbort(self.comm.comm)

            # In a thread with a bound, as vLLM's own destroy() does: the abort may wait on
            # CUDA work of this communicator; the trainer must not.
            aborter = threading.Thread(target=abort, daemon=True)
            aborter.start()
            aborter.join(timeout=30)
            self.comm.disabled = True  # vLLM's communicator then skips every call
            if aborter.is_alive():  # the kernel may still spin on the channel's stream: no restart
                raise EngineError(f"the NCCL weight channel on {self.device} could not be aborted within 30 s; "
                                  f"the trainer's GPU may still wait on it: stop the run and resume it")

    def close(self):
        """Let the channel go (an engine restarted or stopped): on GPUs the communicator is
        aborted within its bound (its peer may be gone: a destroy would wait for it), so that no
        NCCL communicator outlives its engine; on CPUs the process group is dropped."""
        if self.device.type == "cuda":
            self.abort()
        else:
            self.pg = None

    def send(self, buf: torch.Tensor, watch=None) -> None:
        """A 1-D uint8 buffer as (length, bytes)."""
        self.broadcast(torch.tensor([buf.numel()], dtype=torch.int64, device=self.device), watch)
        self.broadcast(buf, watch)

    def recv(self) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buf)
        return buf

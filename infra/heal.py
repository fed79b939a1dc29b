"""
infra/heal.py: a rollout engine that dies is restarted, resynced from the trainer, and what failed is redone.

What it is
----------
`Supervisor(start, restarts=N)` holds one trainer process's rollout engine (`start()` makes
one: vllm_engine.VLLMEngine) and has the engine's interface (`generate`, `apply`, `load_full`,
`fingerprint`, `close`), so the training loop does not change. When the engine is lost
(engine.EngineLost: its process exited, or gave no answer within its timeout, during its
start, a rollout, an evaluation or a sync), the supervisor kills what is left of it, starts a
new one on the same device, rebuilds its weights from the trainer's master with a full sync
(`resync`, given by `attach`), compares fingerprints, and redoes what failed: a generation (a
rollout, an evaluation) is redone with the same seeds; a sync is not redone, since the resync
already sent the weights it would have made. At most `restarts` engines are restarted in a
run (every rank's count together); after that, or when an engine fails with an error of its
own, every rank stops with an EngineError that names each failure. Each restart is one log
line and one entry of `take_events()` (its cause, its ranks, its cost), which train.py writes
to metrics.jsonl.

    engine = Supervisor(lambda: VLLMEngine(...), restarts=3, log=print)
    engine.attach(resync=lambda target, update: engine_sync.full(target, ...), fingerprint=trainer_fp)

Why a healed run is bitwise the run that met no fault
-----------------------------------------------------
- An engine's weights are a function of the trainer's: LoGRA's engine holds bf16 + an int16
  residual, the exact fp32 master (sync.py), which a full fp32 payload rebuilds bit for bit;
  the dense baseline's (and every --sync delta or full engine's) holds bf16(W), which a bf16
  payload rebuilds. Fingerprints confirm.
- A rollout is a function of the weights and one seed per prompt (engine.py, departure 1),
  so the redone rollout samples what the lost one would have.
- Nothing of a failed operation reaches the trainer: a rollout's result is used only once it
  is complete, and a sync changes only the engine.

Every rank agrees
-----------------
Each rank's engine is its own, but the ranks must stay in step: after every rollout and every
sync (the fingerprint that ends it), all ranks agree on whose engine was lost (one all_reduce
of a status; the messages are gathered only when one is set), and heal together: the ranks
whose engine was lost restart it while the others wait in the next collective (for at most
the engine's timeout, shorter than the process group's: options.py checks), then every rank
joins the resync, because gathering the trainer's sharded weights is a collective (a rank
whose engine is fine sends its payloads nowhere). A sync streams one payload per decoder
layer with collectives in between, so an engine lost mid-sync turns the rest of that rank's
payloads into no-ops and the fault is dealt with at the sync's fingerprint. Any other error in
an engine operation on one rank is agreed too: every rank stops, none waits for ever.
"""

import time

import torch
import torch.distributed as dist

from infra.engine import EngineError, EngineLost

OK, LOST, FAILED = 0, 1, 2  # one rank's status after an engine operation


class Supervisor:
    """One rank's engine, restarted and resynced when it is lost (the module docstring)."""

    def __init__(self, start, *, restarts: int, log=print):
        self._start, self.allowed, self.log = start, restarts, log
        self.restarts, self.failures, self.events = 0, [], []
        self.resync = self.trainer_fingerprint = None
        self.engine, self.expected = None, 0  # expected: the update number of the engine's next delta
        self._lost = self._error = None
        self._settled("its start", self._replace)

    def attach(self, *, resync, fingerprint):
        """`resync(target, update)`: the trainer's full weights to `target` (this supervisor, or
        a sink on a rank whose engine is fine) as a full sync at `update`; `fingerprint()`:
        the trainer's fingerprint (collective under FSDP2). Called once the trainer's weights
        exist; until then a restarted engine gets its weights from the trainer's first sync."""
        self.resync, self.trainer_fingerprint = resync, fingerprint

    # -- the engine's interface -------------------------------------------------------------

    def generate(self, *args, **kwargs):
        return self._settled("a generation", lambda e: e.generate(*args, **kwargs))  # a rollout or an evaluation

    def apply(self, payload) -> int:
        self.expected = payload.update + 1  # the trainer has merged this update
        return self._streamed(lambda e: e.apply(payload))

    def load_full(self, payload) -> int:
        self.expected = payload.update
        return self._streamed(lambda e: e.load_full(payload))

    def fingerprint(self):
        """The end of every sync: the agreement on whether any rank's engine was lost in it."""
        return self._settled("a sync", lambda e: e.fingerprint())

    def close(self):
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def take_events(self) -> list[dict]:
        """The restarts since the last call, for the metrics log."""
        events, self.events = self.events, []
        return events

    # -- faults -----------------------------------------------------------------------------

    def _call(self, op):
        """op(engine), a loss or an error recorded instead of raised; None after one."""
        if self._lost is None and self._error is None:
            try:
                return op(self.engine)
            except EngineLost as e:
                self._lost = e
            except Exception as e:
                self._error = e
        return None

    def _streamed(self, op) -> int:
        """One payload of a streamed sync; after a loss on this rank, nothing (bytes 0)."""
        sent = self._call(op)
        return 0 if sent is None else sent

    def _settled(self, what, op):
        """op(engine), then every rank's status agreed; lost engines healed and op redone on
        their ranks (a rank whose engine did it keeps its result)."""
        value, done = None, False
        while True:
            if not done:
                value = self._call(op)
                done = self._lost is None and self._error is None
            reports = self._agree()
            if not reports:
                return value
            self._heal(what, reports)

    def _agree(self) -> list[tuple[int, int, str]]:
        """(rank, status, message) of every rank whose status is not OK: [] when none."""
        status = FAILED if self._error is not None else LOST if self._lost is not None else OK
        message = "" if status == OK else f"{type(self._error or self._lost).__name__}: {self._error or self._lost}"
        if not dist.is_initialized():
            return [] if status == OK else [(0, status, message)]
        flag = torch.tensor([status], dtype=torch.int64)
        if "gloo" not in str(dist.get_backend()):  # NCCL alone (train.py's groups have gloo beside it)
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()) == OK:
            return []
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (status, message))
        return [(r, s, m) for r, (s, m) in enumerate(everyone) if s != OK]

    def _heal(self, what, reports):
        """Restart the lost engines (each counted, a restart that is lost again too), then
        resync them on every rank; raise, on every rank, for an error that is not a loss, or
        once the allowed restarts are spent."""
        t0, healed, cause, replaced = time.monotonic(), [], _first(reports[0][2]), False
        while reports:
            self._account(what if not healed else "its restart", reports)
            healed += [r for r, _, _ in reports]
            if self._lost is not None:  # this rank's engine: kill what is left, start a new one
                self._lost, replaced = None, True
                self._call(self._replace)
            reports = self._agree()
        if self.resync is not None:  # on every rank: gathering the trainer's weights is collective
            self.resync(self if replaced else _SINK, self.expected)
            theirs = self.trainer_fingerprint()
            if replaced and self._call(lambda e: e.fingerprint()) not in (None, theirs):
                self._error = EngineError("a restarted engine's fingerprint differs from the trainer's after the "
                                          "full resync")
        cost = time.monotonic() - t0
        self.events.append({"event": "engine_restart", "during": what, "ranks": healed, "cause": cause,
                            "seconds": round(cost, 3)})
        self.log(f"engine: lost on rank(s) {', '.join(map(str, healed))} during {what} ({cause}); restarted"
                 f"{' and resynced' if self.resync else ''} in {cost:.1f} s ({self.restarts} of "
                 f"{self.allowed} restarts used)")

    def _account(self, what, reports):
        for r, status, message in reports:
            self.failures.append(f"rank {r}, during {what}: {_first(message)}")
        errors = [(r, m) for r, s, m in reports if s == FAILED]
        self.restarts += len(reports)
        if errors or self.restarts > self.allowed:
            self.close()  # every rank stops here, its own engine with it
            if self._error is not None:
                raise self._error
            if errors:
                r, m = errors[0]
                raise EngineError(f"the engine of rank {r} failed during {what}: {_first(m)} (its log says more)")
            raise EngineError(f"{len(self.failures)} engine failure(s), {self.allowed} restart(s) allowed "
                              f"(--engine-restarts): " + "; ".join(self.failures))

    def _replace(self, _=None):
        """Kill what is left of this rank's engine (its process group), start a new one."""
        self.close()
        self.engine = self._start()


class _Sink:
    """Where a rank whose engine is fine sends its share of another rank's resync: nowhere."""

    def load_full(self, payload) -> int:
        return 0


_SINK = _Sink()


def _first(message: str) -> str:
    """An engine error's words without the log lines it quotes (vllm_engine.py's messages end so)."""
    return (message.splitlines() or [""])[0].split("; last lines of ")[0]

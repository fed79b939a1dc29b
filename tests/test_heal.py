"""heal.py: engines that are lost are restarted, resynced and their operation redone; the
allowed restarts are a bound; errors that are not losses stop every rank; two ranks stay in
step when one rank's engine is lost in the middle of a streamed sync. Stand-in engines here;
the vLLM engine processes killed for real are in test_vllm_engine.py."""

import json

import pytest
import torch
import torch.distributed as dist

from infra import heal
from infra.engine import EngineError, EngineLost
from distributed import run_gloo


class Payload:
    def __init__(self, update, layer):
        self.update, self.layer = update, layer


class Standin:
    """An engine whose weights are {layer: update of its last payload}; `plan` says which call
    number of which operation loses it (counted over every engine made by one `Factory`)."""

    def __init__(self, factory):
        self.factory, self.weights, self.closed = factory, {}, False

    def _maybe_lost(self, op):
        f = self.factory
        f.calls[op] = f.calls.get(op, 0) + 1
        if (op, f.calls[op]) in f.plan:
            raise EngineLost(f"engine on the CPU exited with code -9 while waiting for '{op}'; last lines of x.log:\n..")
        if (op, f.calls[op]) in f.errors:
            raise EngineError(f"engine on the CPU failed for '{op}': ValueError: bad payload")

    def generate(self, prompts, seeds):
        self._maybe_lost("generate")
        return [(p, s, dict(self.weights)) for p, s in zip(prompts, seeds)]  # what it sampled, and with what

    def apply(self, payload):
        self._maybe_lost("apply")
        self.weights[payload.layer] = payload.update + 1
        return 10

    def load_full(self, payload):
        self._maybe_lost("load_full")
        self.weights[payload.layer] = payload.update
        return 100

    def fingerprint(self):
        self._maybe_lost("fingerprint")
        return dict(self.weights)

    def close(self):
        self.closed = True


class Factory:
    def __init__(self, plan=(), errors=()):
        self.plan, self.errors, self.calls, self.made = set(plan), set(errors), {}, []

    def __call__(self):
        self.calls["start"] = self.calls.get("start", 0) + 1
        if ("start", self.calls["start"]) in self.plan:
            raise EngineLost("engine on the CPU exited with code -9 while waiting for vLLM to start")
        self.made.append(Standin(self))
        return self.made[-1]


class Trainer:
    """The trainer's side: its weights are {layer: update}, synced layer by layer."""

    layers = ("l0", "l1")

    def __init__(self):
        self.update = 0

    def full_sync(self, target, update):
        return sum(target.load_full(Payload(update, layer)) for layer in self.layers)

    def delta_sync(self, engine):
        sent = sum(engine.apply(Payload(self.update, layer)) for layer in self.layers)
        self.update += 1
        return sent

    def fingerprint(self):
        return {layer: self.update for layer in self.layers}


def supervised(factory, trainer, restarts=3, log=None):
    engine = heal.Supervisor(factory, restarts=restarts, log=log or (lambda line: None))
    engine.attach(resync=trainer.full_sync, fingerprint=trainer.fingerprint)
    trainer.full_sync(engine, 0)
    assert engine.fingerprint() == trainer.fingerprint()
    return engine


def test_a_rollout_and_a_sync_that_lose_the_engine_are_healed():
    lines = []
    factory, trainer = Factory(plan={("generate", 2), ("apply", 3)}), Trainer()
    engine = supervised(factory, trainer, log=lines.append)
    first = engine.generate(["a", "b"], [1, 2])
    trainer.delta_sync(engine)
    assert engine.fingerprint() == trainer.fingerprint() == {"l0": 1, "l1": 1}
    # The rollout that lost its engine is redone on a new one, resynced to update 1 first.
    again = engine.generate(["a", "b"], [1, 2])
    assert [(p, s) for p, s, _ in again] == [(p, s) for p, s, _ in first]
    assert all(w == {"l0": 1, "l1": 1} for _, _, w in again)
    # A sync that loses its engine at its first payload: the second is not sent to the dead
    # engine; the sync's fingerprint restarts it and the resync brings update 2's weights.
    trainer.delta_sync(engine)
    assert engine.fingerprint() == trainer.fingerprint() == {"l0": 2, "l1": 2}
    assert len(factory.made) == 3 and factory.made[0].closed and factory.made[1].closed
    events = engine.take_events()
    assert [(e["during"], e["ranks"]) for e in events] == [("a generation", [0]), ("a sync", [0])]
    assert events[0]["cause"] == "EngineLost: engine on the CPU exited with code -9 while waiting for 'generate'"
    assert json.dumps(events) and engine.take_events() == []
    assert len(lines) == 2 and "restarted and resynced" in lines[0] and "1 of 3 restarts used" in lines[0]


def test_a_start_that_is_lost_is_retried_then_the_run_stops_naming_each_failure():
    factory = Factory(plan={("start", i) for i in range(1, 10)})
    with pytest.raises(EngineError) as err:
        heal.Supervisor(factory, restarts=2, log=lambda line: None)
    message = str(err.value)
    assert factory.calls["start"] == 3  # the first start and 2 restarts
    assert message.startswith("3 engine failure(s), 2 restart(s) allowed (--engine-restarts)")
    assert message.count("while waiting for vLLM to start") == 3 and "rank 0, during its restart" in message


def test_an_error_that_is_not_a_loss_is_not_restarted():
    factory, trainer = Factory(errors={("apply", 1)}), Trainer()
    engine = supervised(factory, trainer)
    trainer.delta_sync(engine)  # the error is held until the sync's end, where it is raised
    with pytest.raises(EngineError, match="bad payload"):
        engine.fingerprint()
    assert len(factory.made) == 1 and factory.made[0].closed  # stopped, not restarted


def _two_ranks(rank, world, out):
    """Rank 1's engine is lost at the first payload of the second sync; between payloads every
    rank runs a collective, as infra/engine_sync.py's factors gathers each layer's rows."""
    factory, trainer = Factory(plan={("apply", 3)} if rank == 1 else set()), Trainer()
    engine = supervised(factory, trainer)
    for _ in range(3):
        for layer in trainer.layers:
            dist.all_reduce(torch.ones(1))  # the gather of this layer's rows
            engine.apply(Payload(trainer.update, layer))
        trainer.update += 1
        assert engine.fingerprint() == trainer.fingerprint()
    ro = engine.generate(["p"], [rank])
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"made": len(factory.made), "events": engine.take_events(), "weights": ro[0][2]}, f)


@pytest.mark.slow
def test_one_ranks_lost_engine_mid_sync_keeps_both_ranks_in_step(tmp_path):
    run_gloo(_two_ranks, 2, str(tmp_path / "r"))
    zero, one = (json.load(open(tmp_path / f"r.{i}")) for i in range(2))
    assert zero["made"] == 1 and one["made"] == 2  # only rank 1 restarted its engine
    # Every rank knows whose engine was restarted, during what and why (the cost each its own clock's).
    without_cost = [[{k: v for k, v in e.items() if k != "seconds"} for e in r["events"]] for r in (zero, one)]
    assert without_cost[0] == without_cost[1] and all(e["seconds"] >= 0 for e in zero["events"] + one["events"])
    assert [e["ranks"] for e in one["events"]] == [[1]] and one["events"][0]["during"] == "a sync"
    assert zero["weights"] == one["weights"] == {"l0": 3, "l1": 3}

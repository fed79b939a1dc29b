"""launch.py: the layout of ranks and engines over nodes, its checks and launch lines, agreement
on refusals, and the shared-folder probe (in two gloo processes). The layout end to end, with
two torchrun "nodes" on this machine: test_train.py and test_vllm_engine.py."""

import ipaddress
import json
import os
import time

import pytest

from infra import launch, vllm_channel, vllm_engine
from infra.launch import Layout, LaunchError
from distributed import run_gloo


def torchrun_env(rank, world, local_world):
    """The variables torchrun gives rank `rank` (node rank // local_world)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % local_world), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world), "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "HOME": "/root"}


@pytest.mark.parametrize("visible", [None, "0,1,2,3", "4,5,6,7"])
def test_every_node_puts_local_rank_i_on_the_ith_engine_gpu(visible):
    """2 nodes x 2 ranks with --engine-gpus 2,3: local rank 1 gets engine GPU 3 on both nodes,
    translated through what the scheduler made visible; the engine sees none of torchrun's
    variables and talks to its trainer on the loopback interface."""
    placed = {}
    for rank in range(4):
        env = torchrun_env(rank, 4, 2)
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        layout = Layout.from_env(env, "2,3")
        assert (layout.nodes, layout.ranks_per_node, layout.world) == (2, 2, 4)
        gpu = layout.engine_gpu(int(env["LOCAL_RANK"]))
        engine_env = vllm_engine.engine_env(gpu, env)
        placed[rank] = (gpu, engine_env["CUDA_VISIBLE_DEVICES"])
        assert not any(k in engine_env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "GROUP_RANK"))
    physical = visible.split(",") if visible else ["0", "1", "2", "3"]
    assert placed == {0: (2, physical[2]), 1: (3, physical[3]), 2: (2, physical[2]), 3: (3, physical[3])}
    assert ipaddress.ip_address(vllm_channel.LOCAL_HOST).is_loopback


def test_layout_from_env_defaults_and_refusals():
    assert Layout.from_env({}) == Layout(1, 1, ())
    assert Layout.from_env({"WORLD_SIZE": "2"}) == Layout(1, 2, ())  # no LOCAL_WORLD_SIZE: one node
    assert Layout.from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "4,5,6,7").engine_gpus == (4, 5, 6, 7)
    with pytest.raises(LaunchError, match="not a multiple of LOCAL_WORLD_SIZE 4"):
        Layout.from_env({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(LaunchError, match="GPU indices"):
        Layout.from_env({}, "4,five")


def test_layout_checks_use_the_nodes_gpus():
    # 2 nodes x 4 ranks with engines on 4..7 of each 8-GPU node: the paper's node, twice.
    launch.check(Layout(2, 4, (4, 5, 6, 7)), 8)
    launch.check(Layout(4, 1, (1,)), 2)
    launch.check(Layout(3, 2, ()), None)  # a CPU run: nothing to count
    bad = [(Layout(2, 4, (4, 5, 6)), 8, "must name 4 distinct GPUs"),
           (Layout(2, 4, (4, 4, 5, 6)), 8, "must name 4 distinct GPUs"),
           (Layout(2, 4, (3, 5, 6, 7)), 8, "training ranks use GPUs 0..3; engines need other GPUs among 0..7"),
           (Layout(2, 4, (4, 5, 6, 8)), 8, "engines need other GPUs among 0..7"),
           (Layout(2, 4, (4, 5, 6, 7)), 6, "has 6 GPUs"),
           (Layout(1, 2, ()), 1, "has 1 GPUs (torch.cuda.device_count()) and this run needs 2 on each node"),
           (Layout(1, 1, ()), 0, "has 0 GPUs")]
    for layout, gpus, message in bad:
        with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
            launch.check(layout, gpus)


def test_launch_lines_name_every_flag_a_node_needs():
    assert launch.commands("--model tiny", Layout(1, 1)) == ["python train.py --model tiny"]
    assert launch.commands("--model 7b", Layout(1, 4)) == ["torchrun --nproc_per_node 4 train.py --model 7b"]
    every_node, slurm = launch.commands("--model 7b", Layout(2, 4, (4, 5, 6, 7)))
    for line in (every_node, slurm):
        assert ("--nnodes" in line and "--nproc_per_node 4" in line and "--rdzv-backend c10d" in line
                and "--rdzv-endpoint" in line and "--rdzv-id" in line
                and line.endswith("train.py --model 7b --run-dir /shared/runs/NAME"))  # a folder every node sees
    assert every_node.startswith("on each of the 2 nodes: torchrun --nnodes 2 ")
    assert slurm.startswith('under Slurm: HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); srun '
                            '--nodes 2 --ntasks-per-node 1 torchrun') and '"$HEAD":29500' in slurm
    assert "$SLURM_JOB_ID" in slurm
    assert launch.commands("--resume /shared/r", Layout(2, 1))[0].endswith("train.py --resume /shared/r")


# --- in two gloo processes ------------------------------------------------------------------

class Refused(Exception):
    pass


def _agree(rank, world, out, failing):
    results = {}
    for name, who in failing.items():
        try:
            launch.agree(Refused(f"rank {rank} refuses") if rank in who else None)
            results[name] = None
        except Refused as e:
            results[name] = [str(e), getattr(e, "agreed", False)]
    value = launch.agreed(lambda: rank * 10)
    try:
        launch.agreed(lambda: 1 / rank)  # rank 0 divides by zero: every rank raises it
        results["agreed"] = None
    except ZeroDivisionError as e:
        results["agreed"] = str(e)
    with open(f"{out}-{rank}.json", "w") as f:
        json.dump({"results": results, "value": value}, f)


@pytest.mark.slow
def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    failing = {"none": [], "rank1": [1], "both": [0, 1]}
    run_gloo(_agree, 2, str(tmp_path / "r"), failing)
    got = [json.load(open(tmp_path / f"r-{rank}.json")) for rank in range(2)]
    for rank, g in enumerate(got):
        assert g["results"]["none"] is None
        assert g["results"]["rank1"] == ["rank 1 refuses", True]
        assert g["results"]["both"] == ["rank 0 refuses", True]  # the lowest rank's words
        assert g["results"]["agreed"] == "division by zero"
        assert g["value"] == 10 * rank


def _probe(rank, world, folders, out):
    launch.PROBE_WAIT_S = 1  # this test's ranks write at once
    for name, paths in folders.items():
        try:
            launch.check_shared_folder(paths[rank])
            result = None
        except LaunchError as e:
            result = str(e)
        with open(f"{out}-{name}-{rank}.json", "w") as f:
            json.dump(result, f)


@pytest.mark.slow
def test_shared_folder_probe(tmp_path):
    """One folder seen by both ranks passes, and is left as it was (folders made for the probe
    are removed again); each rank given its own folder (what unshared mounts of one path look
    like to the ranks) is refused on both ranks, naming the rank whose files are missing."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "keep.txt").write_text("x")
    (tmp_path / "afile").write_text("not a folder")
    folders = {"shared": [str(tmp_path / "shared")] * 2, "made": [str(tmp_path / "new" / "deep")] * 2,
               "apart": [str(tmp_path / "node0"), str(tmp_path / "node1")],
               "unwritable": [str(tmp_path / "fresh" / "deep"), str(tmp_path / "afile" / "x")]}
    run_gloo(_probe, 2, folders, str(tmp_path / "p"))
    result = lambda name, rank: json.load(open(tmp_path / f"p-{name}-{rank}.json"))  # noqa: E731
    assert result("shared", 0) is None and result("shared", 1) is None
    assert sorted(os.listdir(tmp_path / "shared")) == ["keep.txt"]
    assert result("made", 0) is None and not (tmp_path / "new").exists()
    for rank in range(2):
        message = result("apart", rank)
        assert message.split(" is not")[1] == result("apart", 0).split(" is not")[1]  # the same verdict on every rank
        assert "is not one folder shared by every node: rank 0" in message and "rank(s) 1" in message
    assert not (tmp_path / "node0").exists() and not (tmp_path / "node1").exists()
    # Rank 1 cannot write (its path's parent is a file): both ranks refuse, and rank 0's probe
    # and the folders it made for it are gone again.
    assert "rank 1 on" in result("unwritable", 0) and "cannot write there" in result("unwritable", 1)
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "new").exists()


def _agreed_layout(rank, world, out, environs):
    result = {}
    for name, envs in environs.items():
        try:
            layout = launch.agreed_layout(envs[rank], "2,3")
            result[name] = [layout.nodes, layout.ranks_per_node, list(layout.engine_gpus)]
        except LaunchError as e:
            result[name] = str(e)
    with open(f"{out}-{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.mark.slow
def test_the_layout_is_agreed_or_refused_on_every_rank(tmp_path):
    """Nodes that run different numbers of ranks (torchrun allows it) are refused on every
    rank, including the node whose own numbers divide WORLD_SIZE; a sound layout is read the
    same everywhere."""
    environs = {"uneven": [{"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}],
                "even": [{"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}] * 2}
    run_gloo(_agreed_layout, 2, str(tmp_path / "s"), environs)
    for rank in range(2):
        got = json.load(open(tmp_path / f"s-{rank}.json"))
        assert "every node must run the same number of training ranks" in got["uneven"], got
        assert got["even"] == [2, 2, [2, 3]]


def test_restarts_need_a_fresh_store_for_each():
    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(launch.LaunchError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d"):
        launch.check_restarts(shared)
    launch.check_restarts(dict(shared, TORCHELASTIC_USE_AGENT_STORE="False"))  # each restart its own store
    launch.check_restarts(dict(shared, TORCHELASTIC_MAX_RESTARTS="0"))  # no restarts: nothing to meet again
    launch.check_restarts({})  # not under torchrun


def _preempted(rank, world, out):
    """Rank 1 alone receives the signal: both ranks learn of it at the same check."""
    import signal as signals

    stop = launch.Preemption()
    try:
        seen = [stop.agreed()]
        if rank == 1:
            os.kill(os.getpid(), signals.SIGTERM)
        seen.append(stop.agreed())
    finally:
        stop.restore()
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{seen}|{stop.received}")


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_check(tmp_path):
    run_gloo(_preempted, 2, str(tmp_path / "r"))
    assert open(tmp_path / "r.0").read() == "[False, True]|a signal to another rank"
    assert open(tmp_path / "r.1").read() == "[False, True]|SIGTERM"


def _probe_then_hold(rank, world, path, out):
    """check_shared_folder on a folder that does not exist yet, which both ranks count as made
    by them (rank 0 makes it a second late), rank 1's removal of it slowed down by a second;
    then rank 0 takes the run directory's lock there, as train.py does."""
    from infra import run_dir

    launch.PROBE_WAIT_S = 1
    if rank == 1:
        real = os.rmdir

        def slow_rmdir(folder):
            time.sleep(1.0)
            try:
                real(folder)  # may be gone already: rank 0 removed it first
            finally:
                with open(f"{out}-removed", "w") as f:
                    f.write(str(time.time()))

        os.rmdir = slow_rmdir
    else:  # rank 0 makes the folder late, so that both ranks count it as theirs to remove
        real_makedirs = os.makedirs

        def late_makedirs(*args, **kwargs):
            time.sleep(1.0)
            return real_makedirs(*args, **kwargs)

        os.makedirs = late_makedirs
    launch.check_shared_folder(path)
    if rank == 0:
        returned = time.time()
        held = run_dir.hold(path)
        with open(f"{out}-0.json", "w") as f:
            json.dump({"returned": returned, "held": held.fd is not None}, f)


@pytest.mark.slow
def test_the_probe_has_removed_its_folder_on_every_rank_before_any_goes_on(tmp_path):
    """A rank slower to remove the folder the probe made must be done before rank 0 makes the
    run directory again for its lock (it once pulled the folder away from under the lock file:
    ENOENT in a two-node run): rank 0 returns only after rank 1 removed it, and holds the lock."""
    path = str(tmp_path / "runs" / "new")
    run_gloo(_probe_then_hold, 2, path, str(tmp_path / "t"))
    got = json.load(open(tmp_path / "t-0.json"))
    removed = float(open(tmp_path / "t-removed").read())
    assert got["held"] and got["returned"] >= removed, (got, removed)
    assert os.path.exists(os.path.join(path, "run.lock"))

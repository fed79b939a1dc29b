"""Row shards over processes: each trainer process holds the rows of every sketch, direction
and moment that it holds of the weight under FSDP2 (`torch.chunk` of dim 0), as sketch.py's and
rowadam.py's departure 1 describe. `RowShard(group)` is what `sketch.attach(..., shard=...)`
takes: backward reduce-scatters each micro-batch's `dY^T P` (d, r) into its owners' rows, and
`LayerSketch.all_rows` gathers them back; infra/batched.py's `BatchedRowAdam` reduces the
per-layer sums and minima of the formulas over the same group. Tests: tests/test_rowadam.py,
test_directions_across_ranks_equal_the_plain_formulas and
test_row_sharded_state_equals_one_process_bitwise.

Shape legend: d out rows, r rank, n rows of this process.
"""

import torch
import torch.distributed as dist

# torch 2.13 names them *_single; older releases *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def row_shard(d: int, group) -> tuple[int, int]:
    """(first row, row count) of this process's chunk of `d` rows: ceil(d / world) rows each."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-d // world)
    start = min(me * chunk, d)
    return start, min(chunk, d - start)


def _padded_rows(d: int, group) -> int:
    return -(-d // dist.get_world_size(group)) * dist.get_world_size(group)


def reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This process's rows (n, r) of the sum over `group` of every process's `full` (d, r)."""
    if dist.get_world_size(group) == 1:  # one process (FSDP2 on one GPU): the sum is its own
        return full
    d = full.shape[0]
    padded = full if _padded_rows(d, group) == d else \
        torch.cat([full, full.new_zeros(_padded_rows(d, group) - d, *full.shape[1:])])  # (world * chunk, r)
    out = full.new_empty(padded.shape[0] // dist.get_world_size(group), *full.shape[1:])  # (chunk, r)
    _reduce_scatter(out, padded, group=group)
    return out[:row_shard(d, group)[1]]


def gather_rows(local: torch.Tensor, d: int, group) -> torch.Tensor:
    """All `d` rows (d, r) from every process's rows (n, r) (the inverse of the row shard)."""
    world = dist.get_world_size(group)
    if world == 1:  # one process holds every row
        return local
    chunk = -(-d // world)
    padded = local if local.shape[0] == chunk else \
        torch.cat([local, local.new_zeros(chunk - local.shape[0], *local.shape[1:])])  # (chunk, r)
    out = local.new_empty(chunk * world, *local.shape[1:])  # (world * chunk, r)
    _all_gather(out, padded, group=group)
    return out[:d]


class RowShard:
    """The rows of each sketched layer that this process holds over `group`, as FSDP2 shards the
    weights: what `sketch.attach(..., shard=RowShard(group))` takes."""

    def __init__(self, group):
        self.group = group

    def rows(self, d: int) -> tuple[int, int]:
        return row_shard(d, self.group)

    def reduce(self, full: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_rows(full, self.group)

    def gather(self, local: torch.Tensor, d: int) -> torch.Tensor:
        return gather_rows(local, d, self.group)

    def check(self, name: str, module) -> int:
        """This process's row count of the target's sketch; refuses a target whose weight is not sharded
        by rows over the group as FSDP2 does."""
        rows = self.rows(module.out_features)[1]
        weight = module.weight
        local = weight.to_local().shape[0] if hasattr(weight, "to_local") else None
        if local != rows:
            raise ValueError(f"{name}: row-sharded sketches need the weight sharded the same way (FSDP2 "
                             f"fully_shard over the group: {rows} rows here), got "
                             f"{'a replicated weight' if local is None else f'{local} local rows'}")
        return rows

    def saved(self, v: torch.Tensor, weight, d: int):
        """This process's rows of a per-row state (a moment (n,)) as a DTensor on the weight's
        mesh, so that torch.distributed.checkpoint saves every process's rows."""
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(v, weight.device_mesh, [Shard(0)], run_check=False, shape=(d,), stride=(1,))

"""Global all-to-all path: the sharded Muon params of a step that share a shard group of W ranks and a
(direction dtype, update dtype) pair, in one batch of any size per round (Options.rounds); member owners[k]
owns param k (the plan's LPT assignment on Newton-Schulz FLOPs over all of them, muon_dist/plan.py).

Forward: ONE all_to_all_single: member j sends owner o its boxes of the params o owns, concatenated in travel
order (muon_dist/batch.py), with split sizes (uneven and empty boxes need no padding). The owner joins each
param's boxes into exactly its global matrix and runs that param's own kernel. Back: ONE all_to_all_single with
the update boxes in param order (muon_dist/paths/exchange.py). So two collectives per (group, dtype pair), round and
step, whatever the number of shapes.

Reference equation, on every member r and for every param k of the batch:
    run(batch)[k] == box_r(kernel_k(full(batch[k])))
Contract: bitwise: the owner joins exactly the global matrix of each param it owns and runs that param's own
kernel; the exchange only moves bits (proofs/paths.md#global). Traffic per param: its size minus the owner's
box, each way: the lower bound 2 (W - 1) / W of the matrix when even (exchange_bytes).
"""

from __future__ import annotations

from ..batch import Batch
from ..runtime import blocking
from .exchange import batch_bytes, batch_steps, batch_work
from .interface import Path


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    raise AssertionError("global_all_to_all batches are made by the plan's merge, with LPT owners")


def check(batch: Batch) -> None:
    assert len(batch.owners) == len(batch.params), batch


steps = batch_steps(
    "global_all_to_all"
)  # the interface's steps: the exchange of the batch as planned
run = blocking(steps)  # the interface's run: the Steps without pausing


PATH = Path(
    name="global_all_to_all",
    run=run,
    steps=steps,
    owners=owners,
    check=check,
    expected_bytes=batch_bytes,
    work=batch_work,
    collectives=2,  # directions out, updates back
    global_dispatch=False,  # it is the merged batch
    carries_flag=True,  # steps(..., flag=) carries the write group's failure flag in its last collective
    packed_directions=True,  # the step writes the directions into the forward send buffer (exchange_steps)
)

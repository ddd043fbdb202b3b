"""All-to-all path: a batch of k W same-layout params (k full batches of W, packed by the plan), sharded over a
group of W ranks; member j owns params j, j + W, ...

Forward all_to_all_single: member j sends its boxes of the params owned by o to member o, with split sizes, so
uneven and empty boxes need no padding. Each owner joins the boxes into exactly the global matrix, runs the kernel, cuts
the update into boxes and sends them back with a second all_to_all_single (muon_dist/paths/exchange.py). Uneven
shards take this path too and report it under the same name, "all_to_all" (proofs/paths.md#a2a-uneven).

Reference equation, on every member r and for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise, because the owner runs the same kernel on the same unpadded global matrix, and the
exchange only moves bits (proofs/paths.md#a2a). Traffic per param: (W - 1) / W of it each way when even:
the lower bound 2 (W - 1) / W of the matrix (exchange_bytes).
"""

from __future__ import annotations

from ..batch import Batch
from ..runtime import blocking
from .exchange import batch_bytes, batch_steps, batch_work
from .interface import Path


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return tuple(k % group_size for k in range(num_params))


def check(batch: Batch) -> None:
    assert len(batch.params) % batch.group_size == 0 and batch.owners == owners(
        len(batch.params), batch.group_size
    ), batch


steps = batch_steps("all_to_all")  # the interface's steps: the exchange of the batch as planned
run = blocking(steps)  # the interface's run: the Steps without pausing


PATH = Path(
    name="all_to_all",
    run=run,
    steps=steps,
    owners=owners,
    check=check,
    expected_bytes=batch_bytes,
    work=batch_work,
    collectives=2,  # directions out, updates back
    global_dispatch=True,  # dispatch="global" merges its batches into global_all_to_all
    remainder=False,  # takes full batches only
    carries_flag=True,  # steps(..., flag=) carries the write group's failure flag in its last collective
    packed_directions=True,  # the step writes the directions into the forward send buffer (exchange_steps)
)

"""Dump the public names of the torch namespaces this repo calls into, as JSON: the API of one torch version.

    python tests/data/torch_api.py > tests/data/torch_2_9_api.json      (run under the oldest supported torch)

tests/test_torch_api.py compares the names our code uses with this file: a name that the installed torch has
and the oldest supported torch lacks is a newer-only API, and fails the test.
"""

from __future__ import annotations

import importlib
import json
import sys

# the modules our code reaches through `import ... as` aliases and `from ... import`
NAMESPACES = (
    "torch",
    "torch.linalg",
    "torch.nn",
    "torch.nn.functional",
    "torch.optim",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.placement_types",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.profiler",
    "torch.testing",
    "torch.cuda",
)


def public_names(module: str) -> list[str]:
    """Every attribute of the module but dunders (private names too: code may reach _StridedShard)."""
    return sorted(
        name for name in dir(importlib.import_module(module)) if not name.startswith("__")
    )


def main() -> int:
    import torch

    json.dump(
        {"torch": torch.__version__, "names": {ns: public_names(ns) for ns in NAMESPACES}},
        sys.stdout,
        indent=0,
        sort_keys=True,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Execute every notebook headless and write its figures as PNG files (`make notebooks`).

Each stored notebook (notebooks/NAME.ipynb, kept without outputs) runs in a fresh kernel from notebooks/,
as tests/test_notebooks.py runs it but with the kernel's inline matplotlib backend (MPLBACKEND unset: Agg
would draw no output); every image/png output of the executed cells is
written to OUT/NAME_cellK_J.png (K: the cell's index, J: its image's index in that cell). The stored
notebooks are never written. Needs the `notebooks` extra (nbformat, nbclient, ipykernel).

    python notebooks/run_all.py [--out notebooks/figures] [NAME ...]
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("ns_schedules", "ns_numerics", "design_a_schedule", "gram_newton_schulz")


def figures(nb) -> list[tuple[str, bytes]]:
    """(name suffix, PNG bytes) of every image/png output of an executed notebook, in cell order."""
    out = []
    for k, cell in enumerate(nb.cells):
        images = [
            o["data"]["image/png"]
            for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})
        ]
        out += [(f"cell{k}_{j}", base64.b64decode(data)) for j, data in enumerate(images)]
    return out


def run(path: Path, out_dir: Path, timeout: int = 600) -> list[Path]:
    """Execute the notebook at `path` headless; write its figures under out_dir; return their paths."""
    import nbclient
    import nbformat

    os.environ.pop("MPLBACKEND", None)
    root = str(HERE.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, data in figures(nb):
        target = out_dir / f"{path.stem}_{suffix}.png"
        target.write_bytes(data)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python notebooks/run_all.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "names", nargs="*", default=list(NOTEBOOKS), help=f"default: {' '.join(NOTEBOOKS)}"
    )
    parser.add_argument(
        "--out", type=Path, default=HERE / "figures", help="default: notebooks/figures"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(NOTEBOOKS))
    if unknown:
        print(
            f"error: unknown notebook(s) {unknown}; valid: {', '.join(NOTEBOOKS)}", file=sys.stderr
        )
        return 2
    for name in args.names:
        written = run(HERE / f"{name}.ipynb", args.out)
        print(f"{name}: {len(written)} figures in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

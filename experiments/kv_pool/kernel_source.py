"""The command line of the kernel timings beside this file (long_row.py, runs.py): ``--source`` builds our kernel
from another ``attention.cpp`` (the one before a change, so both run on the same machine in turn), ``--label``
names the rows, ``--repeats`` the calls timed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrunahead import kernels


def parsed(repeats: int) -> argparse.Namespace:
    """The arguments, and our kernel built from ``--source`` (else the package's) and chosen; exits where it does
    not build."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, default=None, help="an attention.cpp to build instead of the package's")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--repeats", type=int, default=repeats)
    args = ap.parse_args()
    if args.source is not None:
        kernels.SOURCE = args.source.resolve()
    kernels.set_kernel("ours")
    if not kernels.build():
        sys.exit(f"the kernel did not build: {kernels.why_not_built()}")
    return args

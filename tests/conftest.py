"""Fixtures shared by the test modules (pytest finds them here; test modules never import one another)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_table() -> Callable[..., Path]:
    """A function that writes a partition table into a directory and returns its path: rank 0 takes ``share`` of
    every context, the other ranks split the rest evenly, the key (model, attention, world size, network) and the
    compute settings as asked."""
    # Imported here, not at the top: every test module loads this file, and the torch-free ones must stay so.
    from kvrunahead.decide.tables import Table, TableEntry, TableMeta
    from kvrunahead.model.compute import compute_settings
    from kvrunahead.model.load import resolve_config
    from kvrunahead.sim.shape import config_hash

    def write(directory: Path, model: str = "tiny-llama", attention: str = "split", world_size: int = 2,
              contexts: tuple[int, ...] = (1024, 2048), share: float = 0.7, bandwidth: str = "loopback",
              computes: dict[str, str] | None = None) -> Path:
        # Searched on what this process computes with (not stale) unless ``computes`` says otherwise.
        computes = computes or compute_settings("float32") or {}
        t = Table(TableMeta(model=model, config_hash=config_hash(resolve_config(model)), dtype="float32",
                            world_size=world_size, backend="gloo", transport="torch", device="cpu",
                            threads_per_rank=1, bandwidth=bandwidth, kvr_attention=attention, device_kind="cpu",
                            **computes))
        for ctx in contexts:
            b1 = round(share * ctx)
            rest = [round(b1 + (ctx - b1) * i / (world_size - 1)) for i in range(1, world_size)]
            bounds = [0, b1, *rest]
            t.add(TableEntry(ctx, bounds, [(b - a) / ctx for a, b in zip(bounds, bounds[1:])], 1.0, 1.2, 5, 1.0))
        path = directory / f"{model}_{attention}_p{world_size}.json"
        t.save(path)
        return path

    return write


# The files that take longest, longest first (seconds of one process on a 2-vCPU AVX2 EPYC, summed over each file's
# tests: test_exactness 915, test_tp 827, ... test_pack_cli 71), handed out in this order under ``-n 2 --dist
# loadfile`` too (pytest_configure): the last files a worker takes are then short ones, not a 10-minute file that
# one worker runs while the other waits.
LONGEST_FIRST = ("test_exactness.py", "test_tp.py", "test_spp.py", "test_network.py", "test_serve_fuzz.py",
                 "test_kvp.py", "test_tp_checkpoints.py", "test_serve_engine.py", "test_serve_degree.py",
                 "test_bench.py", "test_mixed_steps.py", "test_serve_front.py", "test_serve_recovery.py",
                 "test_serve_cli.py", "test_search_cli.py", "test_chunking.py", "test_pack.py", "test_hybrid.py",
                 "test_clients.py", "test_launchers.py", "test_serve_heavy.py", "test_kernel_choice.py",
                 "test_compiled.py", "test_attention_memory.py", "test_serve_learning.py", "test_serve_bounds.py",
                 "test_gpu_campaign.py", "test_soak.py", "test_pack_cli.py")


def pytest_configure(config):
    """pytest-xdist hands out whole files in the order collected here, not re-sorted by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The longest files first (a stable sort: a file's tests keep their order). Under ``KVR_TEST_COMPILE=1`` (the
    serve tests with every engine compiled, docs/testing.md) each test's time limit is ``COMPILE_SLOWDOWN`` times
    its own."""
    import os

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if not os.environ.get("KVR_TEST_COMPILE"):
        return
    from tests.helpers import COMPILE_SLOWDOWN  # imports torch: only here
    default = config.getini("timeout") or 300
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = mark.args[0] if mark and mark.args else float(default)
        item.add_marker(pytest.mark.timeout(limit * COMPILE_SLOWDOWN))

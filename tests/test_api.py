"""The public API as the README shows it: one prefill over ranks spawned from a notebook, its result returned."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvrunahead
from kvrunahead import InputError, RunConfig, prefill


def test_prefill_over_two_spawned_ranks_returns_the_result_of_the_single_process():
    cfg = RunConfig(model="tiny-llama", context_len=96, partition="0,60,96", max_new_tokens=4, verify=True, threads=1)
    result = prefill(cfg, nproc=2)
    assert result.world_size == 2 and result.launcher == "spawn"
    assert result.boundaries == [0, 60, 96]
    assert [s.tokens for s in result.ranks] == [60, 36]
    assert result.ranks[0].bytes_sent > 0 and result.ranks[1].bytes_received == result.ranks[0].bytes_sent
    assert result.verification is not None and result.verification.ok
    assert result.generated_tokens == result.verification.reference_tokens and len(result.generated_tokens) == 4


def test_prefill_refuses_bad_input_before_any_rank_starts():
    with pytest.raises(InputError, match="unknown mode"):
        prefill(RunConfig(model="tiny-llama", mode="nope"), nproc=2)


def test_importing_the_package_does_not_import_torch():
    # The CLIs' --help and the torch-free rooms (the search, the tables) rely on a light package import.
    code = "import kvrunahead, sys; assert 'torch' not in sys.modules; kvrunahead.__version__"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_resolves():
    for name in kvrunahead.__all__:
        assert getattr(kvrunahead, name) is not None

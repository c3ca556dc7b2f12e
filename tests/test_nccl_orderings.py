"""The NCCL branch of every mode, p = 2-5, on a recording stand-in for NCCL (tests/nccl_double.py): every batch
keeps to one group, every receive meets its send in an order NCCL can complete, every communicator is made before
the timer starts, a stopped peer ends a rank within its timeout, and the result is still the single process's."""

from __future__ import annotations

import time

import pytest
import torch

from kvrunahead.errors import PeerTimeout
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.load import load_model
from kvrunahead.modes import MODES, Step
from kvrunahead.net import liveness
from kvrunahead.oneshot.runner import timed_prefill
from kvrunahead.partition import Partition, parse_partition
from kvrunahead.ranks.transport import make_transport
from tests.helpers import skewed_ratios
from tests.nccl_double import FakeNccl, replay, setup_problems

CONTEXT = 61
CPU = torch.device("cpu")
WORLD_SIZES = [2, 3, 4, 5]
IDS = torch.randint(0, 200, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()


def partitions(p: int) -> dict[str, str]:
    return {
        "even": "even",
        "skewed": ",".join(f"{x:.4f}" for x in skewed_ratios(p)),
        "one-token-head": ",".join(map(str, [*range(p), CONTEXT])),  # the first p-1 ranks hold one token each
        "one-token-tail": ",".join(map(str, [0, *range(CONTEXT - p + 1, CONTEXT + 1)])),
    }


# (mode, kvr attention or all-gather flavour, partition name): every way a mode moves K,V.
CASES = ([("kvr", attention, pname) for attention in ("masked", "split") for pname in partitions(2)]
         + [(mode, flavour, "own") for mode in ("tsp", "cp-allgather") for flavour in ("native", "p2p")]
         + [("ring", "p2p", "own")])


@pytest.fixture(scope="module")
def models():
    """One model per rank (each rank's thread switches its model's attention), and the single-process logits."""
    ranks = [load_model("tiny-llama", torch.float32, CPU, seed=0) for _ in range(max(WORLD_SIZES))]
    reference = last_token_logits(ranks[0].model, torch.tensor([IDS]))
    return [lm.model for lm in ranks], reference


def prefill_on(rank: int, p: int, model, case: tuple[str, str, str], timeout_s: float = 10.0):
    """One rank's prefill as the runner makes it: the transport (its communicators), the mode's set-up, then the
    timed region. Returns the logits on the emitting rank."""
    mode_name, flavour, pname = case
    mode = MODES[mode_name]
    allgather = flavour if mode_name in ("tsp", "cp-allgather") else "auto"
    transport = make_transport("torch", rank, p, "nccl", timeout_s, allgather, device=CPU)
    partition = Partition.even(CONTEXT, p) if mode.own_partition else parse_partition(partitions(p)[pname], CONTEXT, p)
    ranges = mode.token_ranges(partition)
    my_ids = torch.tensor([[t for a, e in ranges[rank] for t in IDS[a:e]]])
    attention = flavour if mode_name == "kvr" else "masked"
    step = Step(model, my_ids, IDS, ranges, transport, probe_kv_layout(model), CONTEXT, attention)
    state = mode.setup(step)
    emits = rank == mode.emitter(p)
    logits, _, _, _ = timed_prefill(mode, step, state, CPU, emits)
    return logits if emits else None


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=["/".join(c) for c in CASES])
def test_every_mode_keeps_to_nccls_rules_and_matches_the_single_process(models, monkeypatch, p, case):
    torch.set_num_threads(1)
    rank_models, reference = models
    nccl = FakeNccl(p)
    nccl.install(monkeypatch)
    results = nccl.run(lambda rank: prefill_on(rank, p, rank_models[rank], case))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert replay(nccl.programs, p) == []
    assert setup_problems(nccl.programs, p) == []
    (logits,) = [r for r in results if r is not None]
    assert torch.allclose(logits, reference, atol=1e-4)


def test_the_replay_finds_a_receive_queued_before_its_send_on_one_communicator():
    """The replay itself can fail: two ranks that each receive before they send on their one pair deadlock."""
    nccl = FakeNccl(2)
    pair = nccl.new_group_as(0, [0, 1])
    nccl.new_group_as(1, [0, 1])
    for rank in (0, 1):
        nccl.local.rank = rank
        recv = nccl.irecv(torch.empty(4), src=1 - rank, group=pair)
        nccl.isend(torch.zeros(4), dst=1 - rank, group=pair)
        recv.is_completed()
    (problem,) = replay(nccl.programs, 2)
    assert problem.startswith("deadlock under NCCL's ordering")


def test_the_setup_check_finds_a_communicator_made_inside_the_timed_region():
    nccl = FakeNccl(2)
    pair = nccl.new_group_as(0, [0, 1])
    nccl.local.rank = 0
    nccl.record(0, ("mark", "timer starts"))
    nccl.isend(torch.zeros(4), dst=1, group=pair)
    (problem,) = setup_problems(nccl.programs, 2)
    assert "after the timer started" in problem


def test_a_rank_whose_peer_stopped_ends_within_its_timeout_and_aborts_the_communicators(models, monkeypatch):
    torch.set_num_threads(1)
    rank_models, _ = models
    nccl = FakeNccl(2, hang_s=10.0)
    nccl.install(monkeypatch)
    timeout_s = 0.5

    def rank_body(rank: int):
        if rank == 0:  # connects, starts the timed region with the others, then stops sending
            make_transport("torch", 0, 2, "nccl", timeout_s, device=CPU)
            liveness.patient_barrier()
            return None
        start = time.monotonic()
        try:
            prefill_on(1, 2, rank_models[1], ("kvr", "split", "even"), timeout_s)
        except PeerTimeout as e:
            return e, time.monotonic() - start
        return None

    _, outcome = nccl.run(rank_body)
    assert isinstance(outcome, tuple), outcome
    error, elapsed_s = outcome
    assert "rank 1: no progress for 0.5 s waiting for the K,V of layer 0 from rank 0" in str(error)
    assert elapsed_s < timeout_s + 2.0
    assert nccl.aborted == {1}

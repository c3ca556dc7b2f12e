"""The server's warm-up, before ``kvr-serve`` says it is serving: the front decides the layout of every length
(``Placement.decide_up_to``), so that no request waits on a table read, a partition search or the cost model; and
with ``--compile`` it runs the shape families its first requests would otherwise compile on (model/compiled.py), so
no client waits minutes on its first prompt.

Two prompts on the front alone and two over the chain, each pair of different lengths (the second checks that a new
length does not compile again), through the engine's own step (``workers.tell``, then ``executor.run_step``):
every rank compiles its part of a chain prefill, the first rank's without a prefix and the others' behind one.
Decode steps run eager (``BatchDecoder.step``); a chunk behind the earlier ones, packed prompts and KV-parallel
steps compile on first use. Nothing for an eager model.
"""

from __future__ import annotations

import logging
import time

import torch

from kvrunahead.model.compiled import is_compiled
from kvrunahead.partition import Partition
from kvrunahead.serve.step import executor, workers
from kvrunahead.serve.step.plans import Alone, Chain, StepPlan

log = logging.getLogger(__name__)

WARM_UP_TOKENS = 16  # per rank: short, the families are what compiles, not the lengths


@torch.no_grad()
def warm_up(placement, attention: str, max_len: int) -> None:
    """Decide every length's layout up to ``max_len`` tokens and run the warm-up prompts from the front
    (``placement``: its ``Placement``), logged with their seconds; the workers take part in those over the chain
    from their ``worker_loop``."""
    ctx = placement.ctx
    if ctx.is_front:
        placement.decide_up_to(max_len)
    if ctx.rank != ctx.front or not is_compiled(ctx.lm.model):
        return
    places = [(1, "on the front")] + ([(ctx.world_size, "over the chain")] if ctx.world_size > 1 else [])
    log.warning("compiling the first requests' shapes before serving: %s (minutes on a CPU, less with inductor's "
                "cache filled)", " and ".join(where for _, where in places))
    for degree, where in places:
        t0 = time.perf_counter()
        for extra in (0, 5):
            n = WARM_UP_TOKENS * degree + extra
            seg = (Chain("warm-up", (0,) * n, cuts=tuple(Partition.even(n, degree).boundaries)) if degree > 1
                   else Alone("warm-up", (0,) * n))
            plan = StepPlan((seg,), attention)
            if ctx.tp_rank == 0:  # the front; its TP peers run the warm-up themselves, beside it
                workers.tell(ctx, plan, None, placement.heartbeat, peers=False)
            elif ctx.mailbox is None:  # a broadcast to every rank: the peer takes its part
                workers.recv_plan(ctx)
            executor.run_step(ctx, plan)
        log.warning("compiled a prompt's forward %s in %.1f s", where, time.perf_counter() - t0)

"""The front's plans to the other ranks and their life between them: the plan broadcast (from the front to every
rank, as long as they are alive), the workers' loop (and the front's TP peers', which run every step with it), and
the heartbeat that keeps an idle world alive."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import time

import torch
import torch.distributed as dist

from kvrunahead.net import liveness
from kvrunahead.net.liveness import PATIENT_S
from kvrunahead.ranks.mesh import ShmMailbox
from kvrunahead.serve.step.executor import run_step
from kvrunahead.serve.step.plans import Drop, Mirrored, Ping, Plan, Shutdown, StepPlan
from kvrunahead.serve.step.rank import RankContext

log = logging.getLogger(__name__)


def open_plan_routes(ctx: RankContext, world, shared_memory: bool) -> None:
    """How the front's plans reach the other ranks (every rank calls it, together). A TP front on one host tells
    its TP peers through shared memory (mesh.ShmMailbox: a decode step's plan, every step, without a collective)
    and broadcasts to the other groups' ranks on a group of them and itself; else every plan is broadcast to every
    rank."""
    if ctx.tp == 1 or not shared_memory:
        return
    ctx.mailbox = ShmMailbox.of_group(world, ctx.front, os.environ.get("MASTER_PORT", str(os.getppid())))
    others = [r for r in range(ctx.world_size * ctx.tp) if not ctx.front_rank < r < ctx.front_rank + ctx.tp]
    ctx.broadcasts = len(others) > 1
    if ctx.broadcasts:  # made by every rank, members or not (torch.distributed's rule)
        ctx.plan_group = dist.new_group(others, backend="gloo", timeout=datetime.timedelta(seconds=PATIENT_S))


def send_plan(ctx: RankContext, plan: Plan, peers: bool = True, others: bool = True) -> None:
    """Send ``plan`` from the front (as long as the ranks are alive): to its TP peers (``peers``) and to the other
    ranks (``others``); without a mailbox both are one broadcast to every rank."""
    payload = pickle.dumps(plan)
    if ctx.mailbox is not None and peers:
        ctx.mailbox.send(payload)
    if ctx.mailbox is None or (others and ctx.broadcasts):
        tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        _broadcast(torch.tensor([tensor.numel()], dtype=torch.int64), ctx, "the workers to take the next plan")
        _broadcast(tensor, ctx, "the workers to take the next plan")


def tell(ctx: RankContext, plan: StepPlan, decoder, heartbeat: Heartbeat, peers: bool = True) -> None:
    """Tell the other ranks the step the front is about to run: a TP front's peers every step (``Mirrored``, with
    the changes to the front's decode batch, ``decoder``), the workers where any takes part; a step the front runs
    alone keeps the heartbeat. ``peers=False``: not the TP peers' mailbox (the warm-up, which they run themselves;
    a broadcast to every rank they take as ``recv_plan``)."""
    if not plan.needs_workers:
        heartbeat.maybe_ping()
    mirrored = Mirrored(plan, decoder.take_ops() if decoder is not None else ()) if ctx.tp > 1 else None
    if mirrored is not None and ctx.mailbox is not None:  # the peers by shared memory, the workers as without TP
        if peers:
            send_plan(ctx, mirrored, others=False)
        if plan.needs_workers and ctx.broadcasts:
            send_plan(ctx, plan.workers_plan, peers=False)
            heartbeat.sent()
    elif mirrored is not None:
        send_plan(ctx, mirrored)
        heartbeat.sent()
    elif plan.needs_workers and ctx.world_size > 1:
        send_plan(ctx, plan.workers_plan)
        heartbeat.sent()


def recv_plan(ctx: RankContext) -> Plan:
    """The front's next plan; waits as long as the front is alive (its heartbeats), then raises PeerTimeout."""
    if ctx.mailbox is not None:
        return pickle.loads(ctx.mailbox.recv("the front's next plan"))
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(size, ctx, "the front's next plan")
    payload = torch.empty(int(size), dtype=torch.uint8)
    _broadcast(payload, ctx, "the front's next plan")
    return pickle.loads(payload.numpy().tobytes())


def _broadcast(tensor: torch.Tensor, ctx: RankContext, what: str) -> None:
    group = ctx.plan_group if ctx.plan_group is not None else liveness.patient_group()
    work = dist.broadcast(tensor, src=ctx.front_rank, group=group, async_op=True)
    liveness.wait_for_peers(work, what)


def worker_loop(ctx: RankContext, decoder=None, prefixes=None, model_config=None) -> None:
    """A non-front rank's life: run each prefill plan's part until a Shutdown; raises when the front is gone. A TP
    peer of the front (``ctx.mirror``) runs every step whole, with its own ``decoder`` (the front's batch, on its
    shard) and its own ``prefixes`` (the front's prefix cache, its own heads of every entry)."""
    log.info("rank %d (TP rank %d) serving as a %s of front rank %d", ctx.rank, ctx.tp_rank,
             "TP peer" if ctx.mirror else "worker", ctx.front)
    caches: dict = {}  # the caches of the last step's prompts, which the front's next ops add to the batch
    while True:
        plan = recv_plan(ctx)
        if isinstance(plan, Shutdown):
            log.info("rank %d: shutdown", ctx.rank)
            return
        if isinstance(plan, StepPlan):
            run_step(ctx, plan)
        elif isinstance(plan, Mirrored) and ctx.mirror:
            held, answered = _mirror(plan.ops, caches, decoder, prefixes, model_config)
            # a prompt the prefix cache answered joins the batch after the step (the front's next ops)
            caches = {**answered, **run_step(ctx, plan.plan, held, decoder).caches}
        elif isinstance(plan, Mirrored) and plan.plan.needs_workers:
            run_step(ctx, plan.plan.workers_plan)
        elif isinstance(plan, Drop):
            for request_id in plan.request_ids:
                ctx.forget(request_id)


def _mirror(ops: tuple, caches: dict, decoder, prefixes, model_config) -> tuple[list | None, dict]:
    """A TP peer takes the front's changes since the last step, in order: its decode batch's (a request added, with
    this rank's cache of it, or removed) and its prefix cache's. Returns the K,V the step's prompt runs after,
    where the prefix cache held its start, and the caches of the prompts it answered whole."""
    held, answered = None, {}
    for op in ops:
        if op[0] == "add":
            _, request_id, variant, fork = op
            decoder.add(request_id, caches[request_id], variant, bool(fork))  # this rank's entries are tensors
        elif op[0] == "remove":
            decoder.remove(op[1])
        else:
            took = prefixes.replay(op, caches, model_config)
            if took is not None and took[0] == "held":
                held = took[1]
            elif took is not None:
                caches[op[1]] = answered[op[1]] = took[1]
    return held, answered


class Heartbeat:
    """The front's Ping schedule: one broadcast every ``heartbeat_s`` while no prefill broadcast happens."""

    def __init__(self, ctx: RankContext, heartbeat_s: float) -> None:
        self.ctx, self.heartbeat_s = ctx, heartbeat_s
        self.last_s = time.monotonic()
        self.off = False  # a worker is lost: no Ping until the front has joined the workers started again

    def sent(self) -> None:
        self.last_s = time.monotonic()

    def maybe_ping(self) -> None:
        if (not self.off and self.ctx.has_peers and self.ctx.broadcasts
                and time.monotonic() - self.last_s >= self.heartbeat_s):
            send_plan(self.ctx, Ping(), peers=False)  # a TP peer on a mailbox waits on the front's heartbeat
            self.sent()

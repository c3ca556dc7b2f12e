"""A recording stand-in for NCCL process groups, and a replay of what it recorded against NCCL's rules.

``FakeNccl`` replaces the calls of ``torch.distributed`` that the transport makes (``new_group``, ``isend``,
``irecv``, ``P2POp``, ``batch_isend_irecv``, the all-gather into one tensor, ``_abort_process_group``) for p ranks
run as threads of one process on CPU. It moves real tensors, so the prefill runs and can be compared with the
single process, and it behaves as NCCL does where the transport could get it wrong:
- ``batch_isend_irecv`` refuses operations on different groups (torch's own check) and returns one request for
  the whole batch (NCCL coalesces);
- a request's ``wait`` ignores its timeout (NCCL's wait only orders streams unless blocking wait is on): it
  returns when the data is there, or raises ``Hung`` after ``hang_s``;
- sends and receives match in the order they were posted per pair and communicator; tags are ignored.
Every rank's posts, blocking waits and the start of the timed region are recorded in program order.

``replay`` then runs those programs under NCCL's progress rules: each rank's operations on one communicator
execute in order on one stream (a batch is one unit whose operations progress together), a send and its receive
complete only when both are at the head of their streams, a collective when every member's head is it, and a
rank's host thread stops at a blocking wait until that operation completes. It reports a deadlock (with what
every rank is stuck on), a receive with no send or of another size, and a send nobody receives.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import kvrunahead.ranks.transport as transport_module
from kvrunahead.net import liveness


class Hung(RuntimeError):
    """A wait the stand-in gave up on: under NCCL this rank would wait forever."""


@dataclass(frozen=True)
class Group:
    gid: int
    ranks: tuple[int, ...]


WORLD = Group(-1, ())  # the default group; its ranks are the world's


@dataclass
class Op:
    kind: str  # "send", "recv" or "all_gather"
    src: int
    dst: int  # the peer for a send or receive; -1 for a collective
    nbytes: int
    index: int = -1  # its place among the operations of its channel (send k matches receive k)


@dataclass
class Item:
    """One unit on a stream: a single operation, or a batch posted as one group call."""

    iid: int
    rank: int
    group: Group
    style: str  # "plain", "batch" or "collective" (NCCL may give each its own communicator)
    ops: list[Op] = field(default_factory=list)


@dataclass
class P2POp:
    op: Callable
    tensor: torch.Tensor
    peer: int
    group: Group | None = None
    tag: int = 0


class Work:
    def __init__(self, fabric: FakeNccl, item: Item, done: Callable[[], bool]) -> None:
        self.fabric, self.item, self._done = fabric, item, done
        self._recorded = False

    def _record_wait(self) -> None:
        if not self._recorded:
            self._recorded = True
            self.fabric.record(self.item.rank, ("wait", self.item.iid))

    def is_completed(self) -> bool:
        self._record_wait()
        return self._done()

    def wait(self, timeout=None) -> bool:
        self._record_wait()
        deadline = time.monotonic() + self.fabric.hang_s
        while not self._done():
            if time.monotonic() > deadline:
                raise Hung(f"rank {self.item.rank}: item {self.item.iid} never completed")
            time.sleep(1e-4)
        return True


class FakeNccl:
    """p ranks' NCCL, as threads of this process; ``install`` puts it in place of torch.distributed's calls."""

    def __init__(self, world_size: int, hang_s: float = 20.0) -> None:
        self.world_size, self.hang_s = world_size, hang_s
        self.lock = threading.Lock()
        self.local = threading.local()
        self.programs: dict[int, list] = defaultdict(list)
        self.groups: list[Group] = []
        self.groups_made: dict[int, int] = defaultdict(int)
        self.messages: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self.receives_posted: dict[tuple, int] = defaultdict(int)
        self.sends_posted: dict[tuple, int] = defaultdict(int)
        self.collectives: dict[tuple[int, int], dict[int, torch.Tensor]] = defaultdict(dict)
        self.collectives_posted: dict[int, int] = defaultdict(int)
        self.aborted: set[int] = set()
        self.items = itertools.count()
        self.barrier = threading.Barrier(world_size)

    # -- the world's threads
    @property
    def rank(self) -> int:
        return self.local.rank

    def run(self, fn: Callable[[int], object], timeout_s: float = 120.0) -> list:
        """``fn(rank)`` on every rank at once; the results, or the exception each rank raised."""
        results: list = [None] * self.world_size

        def body(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - handed to the test, which asserts on it
                results[rank] = e
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in threads), "ranks still running"
        return results

    def new_group_as(self, rank: int, ranks: list[int]) -> Group:
        """``new_group`` called by ``rank`` (for tests that play the ranks in turn in one thread)."""
        self.local.rank = rank
        return self.new_group(ranks)

    def record(self, rank: int, event: tuple) -> None:
        with self.lock:
            self.programs[rank].append(event)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "isend", self.isend)
        monkeypatch.setattr(dist, "irecv", self.irecv)
        monkeypatch.setattr(dist, "P2POp", P2POp)
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch_isend_irecv)
        monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", self.abort)
        monkeypatch.setattr(transport_module, "_all_gather_single", self.all_gather_single)
        monkeypatch.setattr(liveness, "patient_barrier", self.timer_barrier)

    # -- torch.distributed's calls
    def new_group(self, ranks=None, backend=None, timeout=None, **_):
        with self.lock:
            k = self.groups_made[self.rank]
            self.groups_made[self.rank] += 1
            if k == len(self.groups):
                self.groups.append(Group(k, tuple(ranks)))
            assert self.groups[k].ranks == tuple(ranks), "ranks create their groups in different orders"
            return self.groups[k]

    def timer_barrier(self, what: str = "") -> None:
        self.barrier.wait(self.hang_s)
        self.record(self.rank, ("mark", "timer starts"))

    def abort(self, group=None) -> None:
        self.aborted.add(self.rank)

    def _post(self, group: Group | None, style: str, ops: list[tuple[str, torch.Tensor, int]]):
        """Record one item and put its operations on their channels; per operation, whether it has completed."""
        group = group or WORLD
        me = self.rank
        checks = []
        with self.lock:
            item = Item(next(self.items), me, group, style)
            for kind, tensor, peer in ops:
                assert group is WORLD or peer in group.ranks, f"rank {me}: peer {peer} is not in group {group}"
                src, dst = (me, peer) if kind == "send" else (peer, me)
                channel = (group.gid, style, src, dst)
                if kind == "send":
                    index = self.sends_posted[channel]
                    self.sends_posted[channel] += 1
                    self.messages[channel].append(tensor.detach().clone())
                    checks.append(lambda c=channel, i=index: self.receives_posted[c] > i)
                else:
                    index = self.receives_posted[channel]
                    self.receives_posted[channel] += 1
                    checks.append(self._receiver(channel, index, tensor))
                item.ops.append(Op(kind, src, dst, tensor.numel() * tensor.element_size(), index))
            self.programs[me].append(("post", item))
        return item, checks

    def _receiver(self, channel: tuple, index: int, buf: torch.Tensor) -> Callable[[], bool]:
        copied = []

        def done() -> bool:
            if copied:
                return True
            with self.lock:
                if len(self.messages[channel]) <= index:
                    return False
                msg = self.messages[channel][index]
            if msg.shape != buf.shape:
                raise RuntimeError(f"receive of {tuple(buf.shape)} matched a send of {tuple(msg.shape)} ({channel})")
            buf.copy_(msg)
            copied.append(True)
            return True

        return done

    def isend(self, tensor, dst=None, group=None, tag=0, **_):
        item, (check,) = self._post(group, "plain", [("send", tensor, dst)])
        return Work(self, item, check)

    def irecv(self, tensor, src=None, group=None, tag=0, **_):
        item, (check,) = self._post(group, "plain", [("recv", tensor, src)])
        return Work(self, item, check)

    def batch_isend_irecv(self, p2p_op_list: list[P2POp]):
        group = p2p_op_list[0].group
        if not all(op.group == group for op in p2p_op_list):
            raise ValueError("All ops need to use the same group.")  # torch's _check_p2p_op_list
        ops = [("send" if op.op is dist.isend else "recv", op.tensor, op.peer) for op in p2p_op_list]
        item, checks = self._post(group, "batch", ops)
        return [Work(self, item, lambda: all([c() for c in checks]))]  # one coalesced request, as NCCL gives

    def all_gather_single(self, out, inp, group=None, async_op=False):
        me, p = self.rank, self.world_size
        with self.lock:
            k = self.collectives_posted[me]
            self.collectives_posted[me] += 1
            self.collectives[(WORLD.gid, k)][me] = inp.detach().clone()
            item = Item(next(self.items), me, WORLD, "collective",
                        [Op("all_gather", me, -1, inp.numel() * inp.element_size(), k)])
            self.programs[me].append(("post", item))

        def done() -> bool:
            with self.lock:
                parts = self.collectives[(WORLD.gid, k)]
                if len(parts) < p:
                    return False
                out.copy_(torch.cat([parts[r] for r in range(p)]).view_as(out))
            return True

        return Work(self, item, done)


# -- the replay against NCCL's rules

def replay(programs: dict[int, list], world_size: int) -> list[str]:
    """Problems with these programs under NCCL's progress rules (an empty list when they all complete)."""
    problems: list[str] = []
    ends: dict[tuple, dict[str, list[tuple[Item, Op]]]] = defaultdict(lambda: {"send": [], "recv": []})
    for events in programs.values():
        for event in events:
            if event[0] == "post" and event[1].style != "collective":
                for op in event[1].ops:
                    ends[(event[1].group.gid, event[1].style, op.src, op.dst)][op.kind].append((event[1], op))
    partner: dict[int, Item] = {}  # id(op) -> the item holding the operation it matches
    for channel, sides in ends.items():
        sends, recvs = sides["send"], sides["recv"]
        if len(sends) != len(recvs):
            problems.append(f"{len(sends)} sends and {len(recvs)} receives on channel {channel}")
        for (s_item, s_op), (r_item, r_op) in zip(sends, recvs):
            if s_op.nbytes != r_op.nbytes:
                problems.append(f"rank {r_op.dst} receives {r_op.nbytes} bytes where rank {s_op.src} sends "
                                f"{s_op.nbytes} ({channel}, message {s_op.index})")
            partner[id(s_op)], partner[id(r_op)] = r_item, s_item
    if problems:
        return problems

    pc = dict.fromkeys(programs, 0)
    streams: dict[tuple[int, int, str], deque[Item]] = defaultdict(deque)
    done: set[int] = set()
    matched: set[int] = set()

    def head(item: Item) -> bool:
        q = streams.get((item.rank, item.group.gid, item.style))
        return bool(q) and q[0] is item

    progress = True
    while progress:
        progress = False
        for rank, events in programs.items():  # each host thread runs until it blocks
            while pc[rank] < len(events):
                event = events[pc[rank]]
                if event[0] == "post":
                    item = event[1]
                    streams[(rank, item.group.gid, item.style)].append(item)
                elif event[0] == "wait" and event[1] not in done:
                    break
                pc[rank] += 1
                progress = True
        heads = [q[0] for q in streams.values() if q]
        for item in heads:
            for op in item.ops:
                if id(op) in matched:
                    continue
                if op.kind == "all_gather":
                    members = [q[0] for (r, gid, style), q in streams.items()
                               if q and gid == item.group.gid and style == "collective"]
                    if len(members) == world_size and all(m.ops[0].index == op.index for m in members):
                        matched.add(id(op))
                elif head(partner[id(op)]):
                    matched.add(id(op))
        for item in heads:
            if all(id(op) in matched for op in item.ops):
                streams[(item.rank, item.group.gid, item.style)].popleft()
                done.add(item.iid)
                progress = True
    stuck = {r: programs[r][pc[r]] for r in programs if pc[r] < len(programs[r])}
    pending = [q[0] for q in streams.values() if q]
    if stuck or pending:
        lines = [f"rank {r} waits for item {e[1]}" for r, e in sorted(stuck.items())]
        lines += [f"rank {i.rank} stream (group {i.group.gid}, {i.style}) is stuck at item {i.iid}: "
                  + ", ".join(f"{o.kind} {o.src}->{o.dst} ({o.nbytes} B)" for o in i.ops) for i in pending]
        problems.append("deadlock under NCCL's ordering: " + "; ".join(lines))
    return problems


def setup_problems(programs: dict[int, list], world_size: int) -> list[str]:
    """The set-up rules: a group whose first call is a batch has every rank of it in that batch (torch's rule for
    NCCL), and every communicator the timed region uses (a group and a style) was used before the timer started."""
    problems = []
    for rank, events in programs.items():
        posts = [(i, e[1]) for i, e in enumerate(events) if e[0] == "post"]
        marks = [i for i, e in enumerate(events) if e[0] == "mark"]
        start = marks[0] if marks else len(events)
        first: dict[int, Item] = {}
        for _, item in posts:
            first.setdefault(item.group.gid, item)
        for item in first.values():
            members = set(item.group.ranks) - {rank} if item.group.ranks else set(range(world_size)) - {rank}
            peers = {o.dst if o.kind == "send" else o.src for o in item.ops if o.kind != "all_gather"}
            if item.style == "batch" and peers != members:
                problems.append(f"rank {rank}: the first call on group {item.group.gid} is a batch without every "
                                f"rank of the group")
        before = {(item.group.gid, item.style) for i, item in posts if i < start}
        for i, item in posts:
            if i > start and (item.group.gid, item.style) not in before:
                problems.append(f"rank {rank}: the first {item.style} operation on group {item.group.gid} comes "
                                "after the timer started (its communicator is made inside the timed region)")
                before.add((item.group.gid, item.style))
    return problems

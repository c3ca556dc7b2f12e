"""The front's K,V budget: blocks of ``BLOCK_TOKENS`` positions, sized once at start, each holder's K,V a table of
blocks, a block shared by several holders counted once (vLLM's ``BlockPool``, nano-vllm's ``BlockManager``); and the
engine held to it (``KVRoom``, vLLM's recompute preemption).

Holders are requests (their prompt and the tokens they decoded), the prefix cache's entries, and forks (the ``n``
choices answered from an entry: its blocks by reference, their own tokens in blocks after them).

- A prompt is admitted (the scheduler takes its prefill) only where the pool has its blocks, plus one block for each
  running request (the most the next step's decodes can take). A request carrying questions holds every position it
  may reach at once.
- Before each step every decoding request takes the block its next token needs. Where none is free, the prefix
  cache's entries go first, least recently used first; then the request that arrived last is preempted: its blocks
  freed, and it runs again in one prefill over its prompt and the tokens its stream sent (vLLM's recompute), which
  it takes back silently rather than sending again (``run_again``, as after a worker's loss). Running again, it is
  admitted only with room for every position that prefill and its replay reach.

This pool is the accounting of the front's ``PagedKV`` (model/paged.py, ``rank_kv``): a request admitted holds the
very blocks its K,V are written into, and the prefix cache's entries are holders of the same blocks (a prompt's
blocks shared by its entry and its request, counted once). Prompts in flight (a prefill's cache until it joins the
decode, a chunked prompt's chunks so far) are still tensors of their own, counted here by the blocks they will take.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvrunahead.errors import InputError
from kvrunahead.model.paged import BLOCK_TOKENS, GIB, KVPool, OutOfBlocks, PagedKV, Table  # noqa: F401 - re-exported
from kvrunahead.serve.prefix_cache import PrefixCache
from kvrunahead.serve.scheduler import Scheduler
from kvrunahead.serve.sequence import Event, Request, Sequence, StopText

log = logging.getLogger(__name__)

FREE_SHARE = 0.4  # the default budget: this share of the memory free when the server starts
ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM CPU's budget in GiB, read where --kv-cache-memory is not given (0: the default)


def pool_for(asked_gib: float | None, model_config, element_size: int, tp: int, max_model_len: int,
             free_bytes: int | None = None) -> tuple[KVPool, str]:
    """The front's pool for a model of ``model_config`` computing in ``element_size`` bytes (``1 / tp`` of its K,V
    heads), and where its size came from; ValueError where it cannot hold one request of ``max_model_len``."""
    size, source = budget_bytes(asked_gib, free_bytes)
    block = token_bytes(model_config, element_size, tp) * BLOCK_TOKENS
    pool = KVPool(max(1, size // block), block)
    if pool.tokens < max_model_len:
        raise ValueError(f"the K,V cache ({source}: {pool.describe()}) cannot hold one request of the longest "
                         f"context, {max_model_len} tokens: give --kv-cache-memory at least "
                         f"{pool.blocks_for(max_model_len) * block / GIB:.3g} (GiB), or a lower --max-model-len")
    return pool, source


def token_bytes(model_config, element_size: int, tp: int = 1) -> int:
    """Bytes of K and V one position holds over every layer, on a rank with ``1 / tp`` of the K,V heads."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return 2 * model_config.num_hidden_layers * max(1, heads // tp) * head_dim * element_size


def budget_bytes(asked_gib: float | None, free_bytes: int | None = None) -> tuple[int, str]:
    """The pool's bytes and where they came from: ``--kv-cache-memory`` in GiB, else ``VLLM_CPU_KVCACHE_SPACE``
    (vLLM CPU's, in GiB; 0 or unset: the default), else ``FREE_SHARE`` of the memory free now."""
    if asked_gib:
        return int(asked_gib * GIB), f"--kv-cache-memory {asked_gib:g}"
    if (gib := env_gib()) is not None:
        return int(gib * GIB), f"{ENV}={gib:g}"
    free = available_bytes() if free_bytes is None else free_bytes
    return int(FREE_SHARE * free), f"{FREE_SHARE:.0%} of the {free / GIB:.1f} GiB free at start"


def available_bytes() -> int:
    """The memory free for new allocations: ``MemAvailable`` (the physical memory where /proc/meminfo is missing),
    less where this process's cgroup (a container's, v1 or v2) or one above it allows less."""
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    return min([free, *cgroup_room()])


def cgroup_room(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[int]:
    """The bytes each memory cgroup holding this process (its own and those above it) has left under its limit."""
    rooms = []
    try:
        with open(proc) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return rooms
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if controllers == "":  # v2: memory.max and memory.current, under the unified mount
            base = next((b for b in (root, f"{root}/unified") if os.path.exists(f"{b}/cgroup.controllers")), None)
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = f"{root}/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        while base is not None:
            folder = os.path.join(base, path.lstrip("/"))
            room = _room_in(folder, *files)
            if room is not None:
                rooms.append(room)
            if path in ("", "/"):
                break
            path = os.path.dirname(path.rstrip("/"))
    return rooms


def _room_in(folder: str, limit_file: str, usage_file: str) -> int | None:
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # no limit (v1 writes a page-rounded 2**63)
        return None
    return max(0, int(limit) - usage)


def env_gib() -> float | None:
    """``VLLM_CPU_KVCACHE_SPACE`` in GiB; None where it is unset or 0 (the default); ValueError naming it where it is
    not a number of GiB."""
    env = os.environ.get(ENV, "").strip()
    try:
        gib = float(env) if env else 0.0
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # negative, or not a number (NaN)
        raise ValueError(f"{ENV} must be a number of GiB (0: the default), got {env!r}")
    return gib or None


@dataclass
class Held:
    """The engine's state that running a request again changes: its queue, the front's decode batch, the heartbeat
    to the workers, the requests' samplers, and how a request ends (``finish(seq, reason, error)``)."""

    scheduler: Scheduler
    decoder: object  # serve/step/batch_decode.VariantDecoders
    heartbeat: object  # serve/step/workers.Heartbeat
    samplers: dict
    finish: Callable[..., Event]


def run_again(held: Held, seq: Sequence) -> None:
    """``seq`` back in the queue, first in line, to run again from its prompt: its cache and sampler dropped, the
    tokens it has sent prefilled with its prompt and taken back rather than chosen again (``Sequence.prefill_ids``;
    one a step, ``Sequence.next_token``, where its prefill cannot take them), so its stream goes on where it was."""
    held.scheduler.finish(seq)
    held.decoder.remove(seq.request_id)
    held.samplers.pop(seq.request_id, None)
    seq.replay = seq.output_ids + seq.replay  # sent already: what a replay has retaken, then what it has not
    seq.output_ids, seq.text, seq.prompt_logprobs = [], StopText(seq.request.params.stop), []
    seq.prefilled, seq.chunked, seq.answers, seq.status = 0, False, None, "waiting"
    held.scheduler.requeue(seq)


def reach(request: Request) -> int:
    """The most positions ``request`` may hold: its prompt and ``max_tokens``; a context's questions each with
    theirs."""
    rows = request.questions or [[]]
    return len(request.prompt_ids) + sum(len(q) + request.params.max_tokens for q in rows)


class KVRoom:
    """The pool's holders on the front: each request by its id, the prefix cache's entries by theirs.
    ``preemptable(seq)``: whether a request's K,V are the front's alone (a KV-parallel decode's are not)."""

    def __init__(self, pool: KVPool, prefixes: PrefixCache, held: Held,
                 preemptable: Callable[[Sequence], bool] = lambda seq: True, source: str = "") -> None:
        self.pool, self.prefixes, self.held, self.preemptable = pool, prefixes, held, preemptable
        self.source = source  # where its size came from (said at start)
        self.preemptions = 0
        self._pinned: set[str] = set()  # the entries this step's prompts share: not evicted before they run

    def check_fits(self, request: Request) -> None:
        """Raise ValueError where ``request`` could never be held, the pool empty."""
        need, pool = reach(request), self.pool
        if pool.blocks_for(need) > pool.num_blocks:
            max_tokens = request.params.max_tokens
            asked = (f"{len(request.questions)} questions with max_tokens {max_tokens} each" if request.questions
                     else f"max_tokens {max_tokens}")
            raise ValueError(f"the request may hold {need} positions of K,V (its {len(request.prompt_ids)} prompt "
                             f"tokens and {asked}); the K,V cache holds {pool.tokens} (--kv-cache-memory)")

    def admit(self, seq: Sequence, answered: bool) -> bool:
        """Take ``seq``'s blocks for its prefill (``answered``: the prefix cache holds its prompt whole, and it
        forks the entry); False, taking none, where the pool has no room for them even with the cache's entries
        gone."""
        if seq.request_id in self.pool.tables:  # a chunked prompt's next chunk: held since its first
            return True
        reserve = len(self.held.scheduler.running)
        if answered and (entry := self.prefixes.entry(seq.prefill_ids)) is not None and entry.owner:
            if not self._room(reserve):
                return False
            self.pool.share(seq.request_id, entry.owner, seq.prefill_len)
            self._pinned.add(entry.owner)
            return True
        # a request running again (preempted, or after a worker's loss) holds at once the positions its replay will
        # reach: admitted with less, it would grow again as soon as it runs, with the pool full, and be preempted again
        need = reach(seq.request) if seq.request.questions else seq.prompt_len + len(seq.replay)
        if not self._room(self.pool.needs(seq.request_id, need) + reserve):
            return False
        self.pool.hold(seq.request_id, need)
        return True

    def release(self, seq: Sequence) -> None:
        self.pool.release(seq.request_id)

    def request_blocks(self) -> int:
        """The blocks the requests hold (read from another thread, the metrics': the tables copied first)."""
        prefix = {e.owner for e in list(self.prefixes.entries.values())}
        return self.pool.blocks_of([owner for owner in list(self.pool.tables) if owner not in prefix])

    def make_room(self) -> None:
        """Before a step: every decoding request holds the block its next token goes into, the prefix cache's
        entries evicted and then the requests that arrived last preempted where the pool is out of blocks."""
        self._pinned.clear()
        running = self.held.scheduler.running
        for seq in list(running):
            if seq not in running or seq.request.questions:  # preempted meanwhile; a context holds its reach
                continue
            tokens = seq.next_position + 1
            while not self._room(self.pool.needs(seq.request_id, tokens)):
                victims = [s for s in running if self.preemptable(s) and not s.request.questions]
                if not victims:
                    break
                victim = max(victims, key=lambda s: s.request.arrival_s)  # the last to arrive (vLLM's FCFS)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.pool.hold(seq.request_id, tokens)

    def preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        log.info("the K,V cache is full (%d blocks): %s preempted after %d tokens, to run again from its prompt",
                 self.pool.num_blocks, seq.request_id, len(seq.output_ids))
        run_again(self.held, seq)

    def _room(self, blocks: int) -> bool:
        """Whether ``blocks`` are free, the prefix cache's unpinned entries evicted (least recently used first) as
        far as needed."""
        while self.pool.free_blocks < blocks:
            if not self.prefixes.evict_oldest(skip=self._pinned):
                return False
        return True


def kv_room(config, model_config, max_model_len: int, dtype, ctx, prefixes: PrefixCache, held: Held) -> KVRoom:
    """The front's pool for ``config`` (``--kv-cache-memory``; by default a share of the memory free on its device),
    its size said; a KV-parallel decode (its K,V on every rank, ``ctx.shards``) is never preempted."""
    free = None
    if ctx.device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info(ctx.device)[0]
    try:
        pool, source = pool_for(config.kv_cache_memory_gib, model_config, dtype.itemsize, ctx.tp, max_model_len,
                                free)
    except ValueError as e:
        raise InputError(str(e)) from None
    return KVRoom(pool, prefixes, held, preemptable=lambda seq: seq.request_id not in ctx.shards, source=source)


def rank_kv(room: KVRoom | None, config, model_config, dtype, ctx) -> PagedKV | None:
    """The rank's pool for its decodes' K,V (model/paged.py): on the front the budget's own blocks (``room``: one
    ``KVPool`` for both, the prefix cache's entries among its holders); on a TP peer of the front, which repeats its
    steps and so never holds more, twice its own reading of the budget (its free memory read apart from the front's;
    blocks never written take no memory); None on the other ranks."""
    if room is not None:
        room.prefixes.kv = PagedKV(ctx.layout, room.pool.num_blocks, ctx.layout.dtype, ctx.device, pool=room.pool)
        return room.prefixes.kv
    if ctx.mirror:
        size, _ = budget_bytes(config.kv_cache_memory_gib)
        blocks = 2 * max(1, size // (token_bytes(model_config, dtype.itemsize, ctx.tp) * BLOCK_TOKENS))
    else:
        return None
    return PagedKV(ctx.layout, blocks, ctx.layout.dtype, ctx.device)

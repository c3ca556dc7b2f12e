"""What the front tells every rank to run next (serve/executor.py broadcasts them): a chain prefill, a packed one,
a chunk of a chunked one, a KVP decode step, state to drop, a heartbeat, the end. Pickled, so plain data only."""

from __future__ import annotations

from dataclasses import dataclass

from kvrunahead.model.rope import RopeExtension
from kvrunahead.pack.plan import PackedStep


@dataclass(frozen=True)
class PrefillPlan:
    request_id: str
    ids: list[int]
    boundaries: tuple[int, ...]
    attention: str
    rope: RopeExtension | None = None  # the extension this prompt's length needs, as kvr-prefill plans it
    cached: int = 0  # the first positions, whose K,V the front holds (prefix cache): boundaries start there
    kvp: bool = False  # every rank keeps its own part of the cache and decodes on it (kvrunahead/kvp.py)


@dataclass(frozen=True)
class PackedPlan:
    """Several prompts prefilled as one packed sequence cut at ``boundaries`` (kvrunahead/pack), relayed whole to
    the front, which decodes them all."""

    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    boundaries: tuple[int, ...]

    @property
    def step(self) -> PackedStep:
        return PackedStep(tuple(range(len(self.prompts))), tuple(map(len, self.prompts)), self.boundaries)


@dataclass(frozen=True)
class KvpStep:
    """One decode step of the requests decoding KV-cache parallel: each one's last token, run on every rank."""

    tokens: tuple[tuple[str, int], ...]  # (request id, token)


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of a chunked prefill (serve/chunking.py): positions [cuts[0], cuts[-1]) over the chain, every rank
    holding the positions before them (``RankContext.partial``); ``cuts`` with every part but the last empty: on
    the front alone. After it the front sends each worker the positions of the chunk it lacks, so every rank holds
    [0, cuts[-1]) for the next chunk; after the ``last`` the workers drop theirs and the front decodes."""

    request_id: str
    ids: list[int]  # the prompt up to the chunk's end
    cuts: tuple[int, ...]
    attention: str
    rope: RopeExtension | None = None
    last: bool = False

    @property
    def alone(self) -> bool:
        return self.cuts[0] == self.cuts[-2]


@dataclass(frozen=True)
class Drop:
    """The requests whose state every rank drops: KVP shards, a chunked prefill's positions (finished,
    cancelled)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Ping:
    """Sent while no prefill runs: proves to the workers that the front is alive and to the front that they are."""


@dataclass(frozen=True)
class Shutdown:
    """Ends every worker's loop (the server is stopping)."""


Plan = PrefillPlan | PackedPlan | ChunkPlan | KvpStep | Drop | Ping | Shutdown

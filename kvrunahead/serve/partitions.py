"""The chain's partition of each prompt length on a server.

Where the server learns (``--learn``) and the partition is ``auto``, a length takes the partition at which the
ranks' rates, timed in the chain prefills served at its bucket, balance their compute (search.balance's criterion,
online). Otherwise it is chosen as ``kvr-prefill`` chooses it (policy.choose_partition): with ``auto`` or a table,
once per length step (degree.step_end) at the step's end, the step's other lengths taking that partition's shares.
``Placement.decide_up_to`` makes every step's choice at the server's start: a table read and a cost-model search
belong in no request's step.
"""

from __future__ import annotations

import logging

from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import choose_partition
from kvrunahead.decide.tables import TableError
from kvrunahead.errors import InputError
from kvrunahead.partition import Partition, PartitionError, boundaries_at_rates
from kvrunahead.serve import learning
from kvrunahead.serve.degree import step_end
from kvrunahead.sim.flops import layer_cost

log = logging.getLogger(__name__)


class ChainPartitions:
    """``learner``: the server's LayoutLearner, or None; ``tp``: the ranks in each TP group (a learned partition
    is for whole-model ranks only)."""

    def __init__(self, run: RunConfig, model_config, world_size: int, local_world_size: int, attention: str,
                 tp: int, learner: learning.LayoutLearner | None) -> None:
        self.run, self.model_config, self.attention = run, model_config, attention
        self.world_size, self.local_world_size, self.tp, self.learner = world_size, local_world_size, tp, learner
        cost = layer_cost(model_config)
        self.rank_work = lambda prefix, tokens: cost.rank_flops(prefix, tokens, attention)  # partition.Work
        self._chosen: dict[int, tuple] = {}  # prompt length -> (partition, where it comes from)
        self._learned: dict[int, tuple] = {}  # prompt length -> (the rates it was balanced at, (partition, source))
        self.choices = 0  # policy.choose_partition's calls: one per length step, at the start

    def of(self, n: int) -> tuple[Partition, str]:
        """``n`` tokens' partition and where it comes from: learned where there is one, else as chosen."""
        return self._learned_partition(n) or self.chosen(n)

    def use(self, n: int, partition: Partition, source: str) -> None:
        """The partition already chosen for ``n`` tokens (a one-shot run's plan): used as it is."""
        self._chosen[n] = partition, source

    def chosen(self, n: int) -> tuple[Partition, str]:
        """``n`` tokens' partition as chosen: a table's or ``auto``'s at the end of its length step, in its shares;
        any other (even, explicit) at ``n`` itself. Raises InputError where it cannot cut ``n`` tokens."""
        if n not in self._chosen:
            edge = step_end(n)
            stepped = self.run.table or self.run.partition.strip() in ("auto", "table")
            if not stepped or edge == n:
                self._chosen[n] = self._choose(n)
            else:
                base, source = self.chosen(edge)
                sizes = [b - a for a, b in zip(base.boundaries, base.boundaries[1:])]
                try:
                    self._chosen[n] = Partition.from_ratios(sizes, n), f"{source}; its shares at {edge} tokens"
                except PartitionError as e:
                    raise InputError(str(e)) from None
        return self._chosen[n]

    def _choose(self, n: int) -> tuple[Partition, str]:
        self.choices += 1
        try:
            partition, source, _ = choose_partition(self.run, self.model_config, n, self.world_size,
                                                    self.attention, self.local_world_size)
        except (PartitionError, TableError) as e:
            raise InputError(str(e)) from None
        return partition, source

    def _learned_partition(self, n: int) -> tuple[Partition, str] | None:
        if self.learner is None or self.run.partition != "auto" or self.run.table or self.tp > 1:
            return None
        found = self.learner.rates(n, self.world_size, self.rank_work)
        if found is None:
            return None
        rates, runs = found
        if self._learned.get(n, (None,))[0] != tuple(rates):  # the latest KEEP timings: their count stops growing
            try:  # learned from other lengths of the bucket: valid for this one or not used
                bounds = boundaries_at_rates(rates, self.rank_work, n, learning.QUANTUM)
            except ValueError as e:  # a PartitionError among them
                log.warning("the learned rates %s cannot cut %d tokens (%s): the partition as chosen before", rates,
                            n, e)
                self._learned[n] = tuple(rates), None
                return None
            _, before = self.chosen(n)
            source = (f"learned: balanced at the ranks' rates in {runs} served prefill(s) at "
                      f"{learning.bucket_range(n)} tokens (before: {before})")
            self._learned[n] = tuple(rates), (Partition(bounds), source)
        return self._learned[n][1]

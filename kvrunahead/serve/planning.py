"""The partition of a chain prefill, per request: the policy's own choice (tables, cost model, estimate) or the
``--partition`` given, for a prompt that arrives already tokenised."""

from __future__ import annotations

from kvrunahead.errors import InputError
from kvrunahead.partition import Partition, PartitionError, check_fits, parse_partition
from kvrunahead.policy import RunConfig, _auto_partition, _table_partition, table_key
from kvrunahead.search.tables import TableError


def partition_for(cfg: RunConfig, config, n: int, world_size: int, attention: str, local_world_size: int,
                  threads: int) -> tuple[Partition, str]:
    """What ``policy.prepare`` chooses for a prompt of ``n`` tokens (its partition branch, without re-tokenising):
    ``auto`` asks the table of this setting, else the cost model; ``table`` or ``--table`` the table; else the
    boundaries or ratios given."""
    try:
        key = table_key(cfg, config, world_size, attention, local_world_size)
        if cfg.partition == "table" or cfg.table:
            lookup = _table_partition(cfg, key, n)
            return lookup.partition, lookup.source
        if cfg.partition.strip() == "auto":
            check_fits(n, world_size)
            return _auto_partition(cfg, config, key, n, attention, threads)
        source = "even" if cfg.partition.strip() == "even" else "explicit"
        return parse_partition(cfg.partition, n, world_size), source
    except (PartitionError, TableError) as e:
        raise InputError(str(e)) from None

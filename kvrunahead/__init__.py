"""kvrunahead: KV-Runahead prefill of long prompts over several ranks (Cho, Rastegari, Naik, ICML 2024).

The public API, imported on first use so that ``import kvrunahead`` (and every CLI's ``--help``) stays torch-free:

    from kvrunahead import RunConfig, prefill
    result = prefill(RunConfig(model="smollm2-135m", context_len=4096), nproc=2)
    print(result.ttft_s, result.boundaries, result.first_token_text)
"""

from importlib import import_module

from kvrunahead.version import __version__

_API = {
    "prefill": "kvrunahead.api",  # one prefill over local ranks started here
    "RunConfig": "kvrunahead.config",  # what to run: model, mode, context, partition, network, ...
    "prepare": "kvrunahead.decide.policy",  # the plan of a run (prompt, partition and why), before any rank works
    "InputError": "kvrunahead.errors",
    "run_on_world": "kvrunahead.oneshot.on_engine",  # one prefill on ranks that have joined (torchrun, mpirun)
    "RunResult": "kvrunahead.oneshot.runner",
    "RankStats": "kvrunahead.ranks.stats",
    "World": "kvrunahead.ranks.launcher",
    "init_world": "kvrunahead.ranks.launcher",
    "Partition": "kvrunahead.partition",
    "MODES": "kvrunahead.modes",
    "kvr_prefill": "kvrunahead.modes.kvr",  # the bare mechanism: one rank's part given a ChainLink
    "ChainLink": "kvrunahead.modes.kvr",
    "Table": "kvrunahead.decide.tables",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'kvrunahead' has no attribute {name!r}")

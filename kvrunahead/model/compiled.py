"""The compiled forward: ``torch.compile`` (inductor, dynamic shapes) around the decoder stack of an unmodified
transformers model, in place. Nothing else changes: the chain's cache, the split, ring and KV-parallel attention
and the transports are called from inside the compiled layers as they are from the eager ones (dynamo breaks its
graph at a transfer and resumes after it), so every mode runs compiled. The eager model is the reference the
tests compare against; ``--no-compile`` keeps it.

Where a mode's cache breaks the graph inside a layer (a transfer), the code after the break is compiled per layer
(dynamo specialises on the layer's index; leaving such integers symbolic instead made the whole-stack graph's shape
reasoning run for many minutes), so the limit on recompilations is raised above the layer count times the shape
families. Inductor's on-disk cache lives under the project's cache folder (``KVR_CACHE``, default
``~/.cache/kvrunahead``), so a second start finds the kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from kvrunahead.config import cache_root
from kvrunahead.model.linears import unpack

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 256  # per code object: a layer's resumed code per layer index and shape family (prompt parts,
# chunks behind a prefix, decode rows, packing)


COMPILE_WAIT_S = 1800.0  # how long a rank waits on a compiled peer's K,V: its first call of a family compiles


def inductor_cache_dir() -> Path:
    return cache_root() / "inductor"


def configure() -> None:
    """Dynamo and inductor settings (before the first compiled call). torch keeps dynamo's settings in context
    variables: they hold in this thread and in threads started in a copy of its context (serve/client.py), not in
    others."""
    import torch._dynamo
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # importing dynamo fills the variable with torch's default (under /tmp, which a reboot empties): ours instead,
    # unless the user set another
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())

    # a frame dynamo fails on inside (seen: "sources must not be empty for symbol" guarding a recompiled decode
    # step behind a growing cache) runs eagerly, with a warning, instead of ending the rank
    torch._dynamo.config.suppress_errors = True
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = 16 * RECOMPILE_LIMIT


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """Compile ``model``'s decoder stack in place (its LM head stays eager: it runs on one row); returns it. Nothing
    compiles until the first call of each shape family (the server warms its commonest up at start:
    serve/warm.py)."""
    configure()
    unpack(model)  # inductor picks its own GEMMs: the packed oneDNN weights would be graph breaks
    log.warning("the decoder stack is compiled on its first call of each shape family (inductor's cache: %s)",
                os.environ["TORCHINDUCTOR_CACHE_DIR"])
    model.base_model.compile(dynamic=True, recompile_limit=RECOMPILE_LIMIT)  # the limit in every thread
    model._kvr_compiled = True
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    return getattr(model, "_kvr_compiled", False)


@contextlib.contextmanager
def eager():
    """Run compiled models eagerly inside (the single-process reference a check compares against)."""
    with torch.compiler.set_stance("force_eager"):
        yield

"""The compiled forward: ``torch.compile`` (inductor, dynamic shapes) around the decoder stack of an unmodified
transformers model, in place. Nothing else changes: the chain's cache, the split, ring and KV-parallel attention
and the transports are called from inside the compiled layers as they are from the eager ones (dynamo breaks its
graph at a transfer and resumes after it), so every mode runs compiled. The eager model is the reference the
tests compare against; ``--no-compile`` keeps it.

A layer's index is a plain integer on the module; dynamo would specialise on it and compile every layer anew, so
integers on modules are left dynamic and one graph serves all layers. Inductor's on-disk cache lives under the
project's cache folder (``KVR_CACHE``, default ``~/.cache/kvrunahead``), so a second start finds the kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvrunahead.model.forward import last_token_logits

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # shape families per code object: prompt parts, chunks behind a prefix, decode rows, packing


def inductor_cache_dir() -> Path:
    root = Path(os.environ.get("KVR_CACHE", Path.home() / ".cache" / "kvrunahead"))
    return root / "inductor"


def configure() -> None:
    """Dynamo and inductor settings for the whole process (once, before the first compiled call)."""
    import torch._dynamo
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # importing dynamo fills the variable with torch's default (under /tmp, which a reboot empties): ours instead,
    # unless the user set another
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())

    torch._dynamo.config.allow_unspec_int_on_nn_module = True  # layer_idx: one graph for every layer
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = 16 * RECOMPILE_LIMIT


WARM_UP_TOKENS = 16


def compile_model(model: torch.nn.Module, warm_up: bool = True) -> torch.nn.Module:
    """Compile ``model``'s decoder stack in place (its LM head stays eager: it runs on one row) and, with
    ``warm_up``, compile its two commonest shape families now (a prompt into an empty cache, one decode token
    behind it), so the first request does not pay for them; returns it."""
    configure()
    model.base_model.compile(dynamic=True)
    model._kvr_compiled = True
    if warm_up and getattr(model.base_model, "embed_tokens", True) is not None:  # a pipeline stage takes hidden states
        t0 = time.perf_counter()
        log.warning("compiling the forward (a prompt, then a decode step); inductor's cache: %s",
                    os.environ["TORCHINDUCTOR_CACHE_DIR"])
        device = next(model.parameters()).device
        cache = DynamicCache(config=model.config)
        last_token_logits(model, torch.zeros((1, WARM_UP_TOKENS), dtype=torch.long, device=device), cache)
        t1 = time.perf_counter()
        log.warning("compiled the prompt's forward in %.1f s", t1 - t0)
        last_token_logits(model, torch.zeros((1, 1), dtype=torch.long, device=device), cache,
                          position_ids=torch.tensor([[WARM_UP_TOKENS]], device=device))
        log.warning("compiled the decode step in %.1f s", time.perf_counter() - t1)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    return getattr(model, "_kvr_compiled", False)


@contextlib.contextmanager
def eager():
    """Run compiled models eagerly inside (the single-process reference a check compares against)."""
    with torch.compiler.set_stance("force_eager"):
        yield

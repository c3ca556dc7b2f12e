"""Contexts beyond the trained positions: YaRN through transformers' own rope parameters.

A rotary model asked for more tokens than it was trained on gets its rotary embedding extended by YaRN
(Peng et al., 2023) with the smallest whole factor that covers the context. Only the config changes:
transformers' rope initialisation computes the YaRN frequencies and attention factor, so the model code
stays transformers' and every rank (and the single-process reference) builds the same embedding.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

MAX_YARN_FACTOR = 4


class ContextError(ValueError):
    """A context the model cannot run, with or without an extension."""


@dataclass(frozen=True)
class RopeExtension:
    factor: int
    trained_positions: int

    def describe(self) -> str:
        return f"RoPE extended by YaRN x{self.factor} beyond the {self.trained_positions} trained positions"


def trained_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _plain_rope(config) -> bool:
    """A rotary model without a scaling of its own (YaRN on top of another scaling is not defined)."""
    if getattr(config, "alibi", False):  # Falcon with ALiBi keeps rope parameters it does not use
        return False
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        return False
    return params.get("rope_type", "default") == "default"


def plan_extension(config, context_len: int, allow_long_context: bool = False, name: str = "the model"
                   ) -> RopeExtension | None:
    """The extension a context needs (None: none needed, or ``allow_long_context`` runs it unextended).

    The factor covers the prompt; the tokens decoded after it run a few positions beyond, where YaRN's
    frequencies are defined as well.

    Raises ContextError with one line when the context is beyond what the extension covers, or the model
    has no rotary embedding to extend.
    """
    limit = trained_positions(config)
    if not limit or context_len <= limit or allow_long_context:
        return None
    if not _plain_rope(config):
        raise ContextError(
            f"context of {context_len} tokens exceeds the {limit} positions {name} was trained for, and its "
            "position embedding cannot be extended by YaRN; pass --allow-long-context to run it anyway"
        )
    factor = math.ceil(context_len / limit)
    if factor > MAX_YARN_FACTOR:
        raise ContextError(
            f"context of {context_len} tokens exceeds {limit * MAX_YARN_FACTOR} positions, the most YaRN "
            f"x{MAX_YARN_FACTOR} extends the {limit} positions {name} was trained for to; pass "
            "--allow-long-context to run it without an extension"
        )
    return RopeExtension(factor, limit)


def max_context(config, allow_long_context: bool = False) -> int | None:
    """The longest context ``plan_extension`` lets through: the trained positions times the largest YaRN factor
    where the rotary embedding can be extended, else the trained positions (None: unknown, or no limit asked)."""
    limit = trained_positions(config)
    if not limit or allow_long_context:
        return None
    return limit * MAX_YARN_FACTOR if _plain_rope(config) else limit


def extended(config, ext: RopeExtension | None):
    """A copy of ``config`` with the extension in its rope parameters (``config`` itself when None)."""
    if ext is None:
        return config
    config = copy.deepcopy(config)
    config.rope_parameters = {
        **config.rope_parameters,
        "rope_type": "yarn",
        "factor": float(ext.factor),
        "original_max_position_embeddings": ext.trained_positions,
    }
    # transformers fills a missing original_max_position_embeddings from a top-level attribute of that name
    # where a config has one, and overwrites the rope parameter with it: keep the two the same.
    if hasattr(config, "original_max_position_embeddings"):
        config.original_max_position_embeddings = ext.trained_positions
    config.max_position_embeddings = ext.trained_positions * ext.factor
    return config

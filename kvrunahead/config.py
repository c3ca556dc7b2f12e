"""What one run is: the model, the mode, the prompt, the partition, the network and the rest, as the CLIs and the
Python API give it (plain data: every rank derives its plan from it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_root() -> Path:
    """The project's cache folder (converted models, the kernel's build, inductor's cache, calibrated profiles,
    learned layouts): ``KVR_CACHE``, default ``~/.cache/kvrunahead``."""
    return Path(os.environ.get("KVR_CACHE", Path.home() / ".cache" / "kvrunahead"))


@dataclass
class RunConfig:
    model: str = "smollm2-135m"
    mode: str = "kvr"
    tp: int = 1  # tensor-parallel degree: --nproc ranks form nproc/tp TP groups, chained (mesh.py)
    transport: str = "torch"
    context_len: int | None = 2048
    prompt_text: str | None = None
    chat: bool = True
    partition: str = "auto"  # a matching table, else the cost model; or even, boundaries, ratios, table
    kvr_attention: str = "auto"  # split where the model uses the attention interface, else masked
    table: str | None = None
    force_table: bool = False
    dtype: str | None = None  # float32 on CPU, bfloat16 on GPU; auto: what the hardware is fast in
    compile: bool = False  # the decoder stack through torch.compile (model/compiled.py)
    device: str = "auto"
    threads: int | None = None
    max_new_tokens: int = 1
    decode: str = "gathered"  # or kvp: the K,V stay on the ranks that made them (kvrunahead/decode/kvp.py)
    verify: bool = False
    atol: float | None = None
    timeout_s: float = 60.0
    allow_long_context: bool = False  # beyond the trained positions without a RoPE extension
    seed: int = 0
    net: str | None = None  # --net: "loopback", "cap=400MB/s", "cap=13MB/s,noise"; None: loopback for one host
    allgather: str = "auto"  # all-gather modes: the library's collective or a ring of point-to-point transfers
    stages: str = "auto"  # spp: the layer boundaries of the stages ("0,15,30"), or auto (balanced by the cost model)
    chunk_tokens: int | None = None  # spp: the chunk pipelined through the stages; None: the cost model's

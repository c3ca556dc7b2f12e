"""Serving over persistent ranks (issue 26): nano-vllm's split of a request's state (``sequence``), a scheduler
that decides (``scheduler``), an executor that runs a step on every rank (``executor``, ``decode``, ``sampling``),
an engine whose step is schedule -> execute -> postprocess (``engine``) and its asyncio client (``client``)."""

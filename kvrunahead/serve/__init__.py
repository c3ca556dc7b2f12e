"""Serving over persistent ranks, as nano-vllm splits it: a request's state (``sequence``), a scheduler that
decides (``scheduler``, the chunk's size by ``chunking``), an engine whose step is schedule -> place -> execute ->
postprocess (``engine``, ``planner``, ``placement``) and its asyncio client (``client``); the HTTP face is ``http/``
and what every rank runs in a step is ``step/``."""

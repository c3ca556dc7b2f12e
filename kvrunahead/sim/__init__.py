"""TTFT cost model and cluster simulator (paper sections 3-5, eq. 1-7).

``shape``: what a model costs per token and per query-key pair; ``profile``: what a device and its links
deliver (measured by ``kvr-calibrate`` or built from public figures); ``costmodel``: the two combined into
the time of every per-layer step; ``simulate``: the per-layer schedule of every mode replayed on p ranks;
``optimize``: partitions from the simulator; ``plan``: rank count, mode and partition for a context length.
"""

"""The network the ranks talk over: its setting (``--net``), emulated hosts with rate caps, a noise sidecar,
and the liveness checks that keep a fault from hanging a job."""

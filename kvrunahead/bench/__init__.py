"""``kvr-bench``: TTFT of every prefill mode, measured on real ranks."""

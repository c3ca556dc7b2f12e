"""The offline measurements that write the cost model's profiles: kernels (kvr-calibrate) and links."""

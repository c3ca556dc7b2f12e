"""Decoding over ranks: KV-parallel decode (``kvp``: Medha's KVP, each rank attending over its slice of the cache,
the partial results merged by their log-sum-exp) and many questions over one shared prefix (``shared_prefix``)."""

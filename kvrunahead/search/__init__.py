"""The partition search (torch-free, given a ``measure`` function), its tables and ``kvr-search``."""

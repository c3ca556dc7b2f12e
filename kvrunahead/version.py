"""The package's version, for the provenance of what it writes."""

__version__ = "0.1.0"

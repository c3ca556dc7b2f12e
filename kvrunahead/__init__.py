"""KV-Runahead: parallel prefill of long prompts by handing the KV cache down a chain of ranks."""

__version__ = "0.1.0"

"""The command lines: ``prefill.py`` is ``kvr-prefill``; ``common.py`` holds what every CLI shares."""

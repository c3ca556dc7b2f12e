"""What every command line shares: its click settings, the options that mean the same everywhere, and the ending
of a failed run (bad input: one line and exit 2; a peer that stopped answering: one line and exit 1).

Torch-free, so that ``--help`` and the input checks answer before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator

import click

from kvrunahead.choices import (
    ALLGATHERS,
    ATTENTION_KERNEL_ENV,
    ATTENTION_KERNELS,
    DEFAULT_MODEL,
    DEVICES,
    DTYPE_CHOICES,
    KVR_ATTENTIONS,
    LINEARS,
    LINEARS_ENV,
)
from kvrunahead.errors import InputError, LaunchError, PeerTimeout, ProfileError
from kvrunahead.net.spec import NetError
from kvrunahead.prompt import PromptError

SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
BAD_INPUT = (InputError, LaunchError, NetError, PromptError, ProfileError)


def model_option(help: str | None = None):
    return click.option("--model", default=DEFAULT_MODEL, show_default=True, help=help)


def net_option(help: str):
    return click.option("--net", default=None, help=help)


def timeout_option(default: float, help: str | None = None):
    return click.option("--timeout", "timeout_s", type=float, default=default, show_default=True, help=help)


def kvr_attention_option(help: str):
    return click.option("--kvr-attention", type=click.Choice(KVR_ATTENTIONS), default="auto", show_default=True,
                        help=help)


def allgather_option(help: str):
    return click.option("--allgather", type=click.Choice(ALLGATHERS), default="auto", show_default=True, help=help)


DTYPE_HELP = ("Default: float32 on CPU, bfloat16 on GPU. auto: what the hardware is fast in (bfloat16 on a CPU "
              "with avx512_bf16 or AMX whose bfloat16 GEMMs kvr-kernels timed faster than float32's, else float32; the "
              "model's 16-bit dtype on a GPU).")


def dtype_option(help: str = DTYPE_HELP):
    return click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None, help=help)


def compile_option():
    return click.option(
        "--compile/--no-compile", "compile", default=False, show_default=True,
        help="Run every rank's decoder stack through torch.compile (inductor, dynamic shapes). The first call of "
             "each shape family compiles (minutes on a CPU; logged); inductor's cache under ~/.cache/kvrunahead "
             "(KVR_CACHE) makes later starts quicker. It unpacks the CPU linears for inductor's GEMMs: on the "
             "CPU kernels it ran slower than eager (experiments/kernels).")


def _choice_in_env(flag: str, env: str, choices: tuple[str, ...], help: str):
    """An option whose choice travels as the environment variable ``env``: this process and every rank it starts
    (the tool's own, torchrun's or mpirun's running the same command line) read it there."""

    def choose(ctx, param, value):
        if value is not None:
            os.environ[env] = value
        return value

    return click.option(flag, type=click.Choice(choices), default=None, expose_value=False, callback=choose,
                        is_eager=True, help=f"{help} {env} sets the same.")


def attention_kernel_option():
    return _choice_in_env(
        "--attention-kernel", ATTENTION_KERNEL_ENV, ATTENTION_KERNELS,
        "CPU attention: auto (default: the faster on this CPU in each dtype, timed once when the kernel is built; "
        "kvr-kernels prints the rates), ours (kvrunahead's kernel, built once into ~/.cache/kvrunahead; torch's "
        "where it cannot be built) or torch (torch's SDPA and flash kernels).")


def linears_option():
    return _choice_in_env(
        "--linears", LINEARS_ENV, LINEARS,
        "CPU linear layers: auto (default: the faster on this CPU in each dtype of oneDNN with the weights packed "
        "once and torch's F.linear, timed once per machine and torch version; kvr-kernels prints the rates), "
        "onednn or torch.")


def tp_option():
    return click.option(
        "--tp", type=int, default=1, show_default=True,
        help="Tensor-parallel degree: the --nproc ranks form --nproc/--tp groups; each group's ranks hold a shard "
             "of every layer (Megatron: q, k, v, gate, up by columns, o and down by rows, cut by the model's "
             "base_model_tp_plan and read shard by shard) and all-reduce twice per layer; the groups are the "
             "chain's ranks.")


def device_option(help: str | None = None):
    return click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True, help=help)


def allow_long_context_option(help: str | None = None):
    return click.option("--allow-long-context", is_flag=True, help=help)


def quiet(verbose: bool) -> None:
    """Logging for a CLI: progress with ``--verbose``; otherwise warnings only, and transformers' warnings and
    progress bars (weights loading on every rank) silenced."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not verbose:
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read where transformers is first imported
        hf_logging = sys.modules.get("transformers.utils.logging")
        if hf_logging is not None:  # imported already, by the CLI's own imports
            hf_logging.disable_progress_bar()


def fail(prog: str, message: str) -> None:
    """Bad input: one line, exit 2."""
    click.echo(f"{prog}: error: {message}", err=True)
    sys.exit(2)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def hard_exit(prog: str, message: str) -> None:
    """One line, then exit 1 without interpreter teardown, which can block on a broken process group."""
    click.echo(f"{prog}: {message}", err=True)
    sys.stderr.flush()
    os._exit(1)


def _end_rank(prog: str, e: Exception, who: str, timeout_note: str = "", blank: str = "") -> None:
    """A failed rank: a peer timeout as its one line, anything else named by its type and first line (``blank``
    where it has none); exit 1."""
    if isinstance(e, PeerTimeout):
        hard_exit(prog, f"{e}{timeout_note}")
    hard_exit(prog, f"{who} failed: {type(e).__name__}: {_first_line(e) or blank}")


@contextlib.contextmanager
def failure_ending(prog: str, *, rank: str | None = None, timeout_note: str = "",
                   reraise: bool = False) -> Iterator[None]:
    """End a failed run the way every CLI does: bad input exits 2 with one line; a peer timeout exits 1 with one
    line (plus ``timeout_note``). Where ``rank`` is given (code that runs on a rank), any other failure also ends
    in one line naming the rank and exit 1 (``reraise``: show the traceback instead, for --verbose)."""
    try:
        yield
    except BAD_INPUT as e:
        fail(prog, str(e))
    except Exception as e:
        if not isinstance(e, PeerTimeout) and (rank is None or reraise):
            raise
        _end_rank(prog, e, f"rank {rank}", timeout_note, blank=type(e).__name__)


@contextlib.contextmanager
def rank_ending(prog: str) -> Iterator[None]:
    """End a failed rank whose orchestrator reads only its exit code (kvr-bench's workers, whose input was
    checked before they started): a peer timeout or any other failure is one line and exit 1."""
    try:
        yield
    except Exception as e:
        _end_rank(prog, e, "rank")


def read_prompt_file(path: str) -> str:
    """The text of a prompt file; one-line errors for an empty file or one that is not UTF-8 text."""
    data = open(path, "rb").read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if not text.strip():
        raise InputError(f"{path} is empty (or only whitespace): nothing to prefill")
    return text


def read_prompts_file(path: str) -> list[str]:
    """The prompts of a JSON-lines file, one ``{"prompt": "..."}`` per line (the completions API's field); blank
    lines are skipped; one-line errors name the line."""
    prompts = []
    for n, line in enumerate(read_prompt_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not JSON ({e.msg})") from None
        text = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text:
            raise InputError(f'{path}:{n}: expected {{"prompt": "<non-empty text>"}}')
        prompts.append(text)
    return prompts


def env_rank() -> str:
    """This process's rank as its launcher set it (torchrun, mpirun), known before any process group; "0" alone."""
    return os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def check_nproc(nproc: int, launcher: str, world_size: int) -> None:
    """``--nproc`` against the launcher: at least 1, and under torchrun or mpirun 1 or the world they started."""
    if nproc < 1:
        raise InputError("--nproc must be at least 1")
    if launcher != "single" and nproc not in (1, world_size):
        raise InputError(f"--nproc {nproc} given, but the launcher started {world_size} ranks")

"""``kvr-serve``: an OpenAI-compatible server whose long prompts are prefilled by the KV chain.

Every rank loads the model once and joins the world; the front (the last rank, where the chain leaves the full
cache) runs the engine loop and uvicorn, the other ranks run the engine's worker loop. SIGTERM drains (new
requests get 503, those in flight finish within ``--grace``) and exits 0. Under ``--nproc`` a worker that dies,
stops or is cut off is started again while the front serves on (``--recover``: serve/recovery.py); the front's
death, or any rank's otherwise, ends every request in flight with an error and the server exits 1, for
``--restarts`` or a supervisor to start it again.
"""

from __future__ import annotations

import logging
import signal
import sys

import click

from kvrunahead.choices import SCHEDULES, SERVE_DECODES
from kvrunahead.cli import common
from kvrunahead.cli.serve_checks import check, check_listen, engine_config
from kvrunahead.errors import InputError

log = logging.getLogger("kvrunahead")

PROG = "kvr-serve"
ACCESS = ("api_key", "ssl_keyfile", "ssl_certfile")  # the front's alone: the engine never sees them


def _announce(url: str, model_id: str, world, kv):
    ranks = f"{world.world_size} rank(s)" if world.tp == 1 else \
        f"{world.world_size} TP group(s) of {world.tp} ranks"

    def started(server) -> None:
        click.echo(f"{PROG}: K,V cache: {kv.pool.describe()} ({kv.source})", err=True)
        click.echo(f"{PROG}: serving {model_id} on {url.format(port=server.port)} over {ranks}", err=True)
    return started


def serve_front(engine, host: str, port: int, grace_s: float, verbose: bool,
                max_request_bytes: int = 4 * 1024 * 1024, access: dict | None = None) -> str | None:
    """Run the engine loop and the HTTP server on this (the front) rank until drained or the engine dies; returns
    why the engine failed, None after a clean stop. The workers are told to shut down either way. ``access``: the
    API key and TLS files (``api_key``, ``ssl_keyfile``, ``ssl_certfile``), each None where not given."""
    import uvicorn

    from kvrunahead.serve.client import AsyncEngineClient
    from kvrunahead.serve.http.app import build_app
    from kvrunahead.serve.http.metrics import Metrics
    from kvrunahead.serve.http.server import DrainingServer

    client = AsyncEngineClient(engine)
    metrics = Metrics(client.model_id)
    metrics.track(lambda: engine.waiting, lambda: len(engine.scheduler.running),
                  lambda: float(getattr(engine.recovery, "lost", None) is not None),
                  lambda: getattr(engine.recovery, "restarts", 0),
                  lambda: engine.placement.prefixes.bytes, client.step_age_s, engine.kv)
    access = access or {}
    config = uvicorn.Config(build_app(client, metrics, max_request_bytes, access.get("api_key")), host=host,
                            port=port, lifespan="off", log_level="info" if verbose else "warning",
                            access_log=verbose, timeout_graceful_shutdown=5,
                            ssl_keyfile=access.get("ssl_keyfile"), ssl_certfile=access.get("ssl_certfile"))
    scheme = "https" if access.get("ssl_certfile") else "http"
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{{port}}/v1"
    server = DrainingServer(config, client, grace_s,
                            on_started=_announce(url, client.model_id, engine.world, engine.kv))
    try:
        server.run()
    finally:
        client.shutdown()  # ends the loop: errs anything left, sends the workers their Shutdown plan
    if not server.started:
        return f"could not listen on {host}:{port}"
    return server.failure and (engine.error or server.failure)


def _ignore_stop_signals() -> None:
    """A worker outlives SIGTERM and SIGINT (a launcher or a terminal sends them to every rank): it ends on the
    front's Shutdown plan after the drain, or within --timeout of the front's silence."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: log.info("worker: signal %d ignored; the front decides the shutdown", s))


def run_rank(options: dict, launcher: str, host: str, port: int, grace_s: float, verbose: bool) -> None:
    """Join the world and serve: the front runs HTTP, the others the worker loop."""
    from kvrunahead.model.device import resolve_device
    from kvrunahead.oneshot.runner import leave_world
    from kvrunahead.ranks.launcher import init_world, local_rank_hint, pick_backend
    from kvrunahead.ranks.mesh import chain_world
    from kvrunahead.ranks.setup import ready_before_joining
    from kvrunahead.serve.engine import Engine

    config = engine_config(options)
    device = resolve_device(config.run.device, local_rank_hint())
    ready_before_joining(config.run, launcher)
    world = chain_world(init_world(launcher, pick_backend(device), config.run.timeout_s, device), config.run.tp)
    front = world.rank == world.world_size - 1 and world.tp_rank == 0  # the last group's first TP rank
    if not front:
        _ignore_stop_signals()
    engine = Engine(config, world)  # a failure from here on ends the rank without teardown (failure_ending)
    if front:
        failure = serve_front(engine, host, port, grace_s, verbose, options["max_request_bytes"],
                              {k: options[k] for k in ACCESS})
        if failure is not None:  # the process group may be broken: no teardown (it can block)
            common.hard_exit(PROG, f"stopped: {failure}")
    else:
        engine.worker_loop()
    leave_world()


@click.command(context_settings=common.SETTINGS)
@common.model_option(help="A preset or a local transformers model directory; its id is the API's `model`.")
@click.option("--nproc", type=int, default=1, show_default=True,
              help="Start this many local ranks (when not launched by torchrun or mpirun).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0: any free port).")
@click.option("--api-key", envvar=["KVR_API_KEY", "VLLM_API_KEY"], default=None,
              help="Requests to /v1/... and /tokenize, /detokenize must carry 'Authorization: Bearer <key>' (else "
                   "401, compared in constant time); /health, /metrics and /version stay open. Also read from "
                   "KVR_API_KEY or VLLM_API_KEY.")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve HTTPS with this private key (PEM); with --ssl-certfile.")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve HTTPS with this certificate chain (PEM); with --ssl-keyfile.")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for their prefill; more are refused at once with 429 and Retry-After.")
@click.option("--max-request-bytes", type=int, default=4 * 1024 * 1024, show_default=True,
              help="Request bodies over this size are refused with 413 before they are read whole or tokenised.")
@click.option("--pack-tokens", type=int, default=8192, show_default=True,
              help="Prompts waiting together are prefilled as one packed sequence (each seeing only itself; "
                   "Prepacking) up to this many tokens; 0: one prompt per prefill. A response's kvrunahead.packed_with "
                   "and /metrics' kvr_packed_requests show it.")
@click.option("--decode", type=click.Choice(SERVE_DECODES), default="auto", show_default=True,
              help="How a prompt prefilled over the chain decodes: auto = per request, kvp where reading its K,V "
                   "outweighs reading the weights and the cost model predicts the KVP step faster (long contexts), "
                   "else gathered (in the front's batch); gathered = on the front, which the chain leaves "
                   "holding the whole cache; kvp = every rank keeps its own part and attends it, the partial "
                   "outputs merged per layer (KV-cache parallelism; packed, prefix-cached and one-rank prefills "
                   "decode gathered). kvrunahead.decode shows which.")
@click.option("--prefill", type=click.Choice(["chain", "spp"]), default="chain", show_default=True,
              help="How a prompt prefills over the ranks: chain = KV-Runahead (each rank a part of the prompt, the "
                   "K,V handed down the chain); spp = Medha's stream pipeline (each rank a stage of the layers, "
                   "the prompt's chunks pipelined through them, hidden states handed on; the stages' K,V then "
                   "gathered on the front, which decodes). With spp, packed prompts, the new tokens after a cached "
                   "prefix and prompts asking for their log-probabilities still run over the chain. "
                   "kvrunahead.partition_source says which ran.")
@click.option("--stages", default="auto", show_default=True,
              help="--prefill spp: the stages' layer boundaries (0,15,30), or auto: stages of equal predicted time.")
@click.option("--spp-chunk-tokens", type=int, default=0, show_default=True,
              help="--prefill spp: tokens handed from stage to stage at a time; 0: the cost model's best for the "
                   "prompt's length.")
@click.option("--step-budget-ms", type=float, default=0.0, show_default=True,
              help="A prompt whose prefill the cost model (this machine's profile, kvr-calibrate) predicts to take "
                   "longer is prefilled in chunks, each the longest predicted to fit this budget (smaller as the "
                   "cache grows), one per engine step: decodes and short prompts run between them (Medha's adaptive "
                   "chunking; the predictions scaled by how the last chunks ran against them); 0: off. "
                   "kvrunahead.chunks shows each chunk, its time, the prediction and its correction.")
@click.option("--chunk-tokens", type=int, default=0, show_default=True,
              help="Chunks of this many tokens instead, whatever they cost (Sarathi-style); 0: off.")
@click.option("--schedule", type=click.Choice(SCHEDULES), default="fcfs", show_default=True,
              help="Which waiting prefill goes next: fcfs = first come, first served; lars = least relative slack "
                   "(the time to the request's TTFT target less its predicted remaining prefill, per second of its "
                   "whole prefill), no request passed over more than 8 prefill steps in a row. With lars a long "
                   "prefill yields part of the step budget while shorter ones wait, and a prefill of up to 3 budgets "
                   "runs whole where its chunks would miss its TTFT target.")
@click.option("--mixed-steps/--separate-steps", default=True, show_default=True,
              help="Mixed: every engine step carries each running request's next token beside the next prefill or "
                   "chunk, in the front's forward of it where they share a model (stall-free batching, as vLLM v1 "
                   "and Sarathi); a step takes its chunk's budget plus one decode token of every running request. "
                   "Separate: a step is a prefill (or chunk) or a decode, never both.")
@click.option("--ttft-slo-s", type=float, default=2.0, show_default=True,
              help="LARS's default TTFT target: the larger of this and --ttft-slo-factor times the request's "
                   "predicted prefill alone (a request may ask its own: ttft_target_s in the body).")
@click.option("--ttft-slo-factor", type=float, default=4.0, show_default=True,
              help="See --ttft-slo-s.")
@click.option("--prefix-cache-tokens", type=int, default=32768, show_default=True,
              help="Prompts' K,V kept (this many tokens in all, least recently used out) so that a prompt starting "
                   "with one of them (64 tokens or more) prefills only its new tokens (over the chain where the "
                   "degree policy puts that many on it); 0: off. "
                   "Full-attention models within their trained positions; kvrunahead.cached_tokens shows it.")
@click.option("--max-model-len", type=int, default=None,
              help="Most tokens per request, prompt and output together. Default: the longest context the model "
                   "takes, its trained positions times 4 where its rotary embedding can be extended by YaRN. Each "
                   "prompt runs as kvr-prefill runs it: beyond the trained positions with the smallest YaRN factor "
                   "that covers it (the weights are loaded once per factor in use), within them unextended.")
@click.option("--kv-cache-memory", "kv_cache_memory", type=float, default=None,
              help="GiB of K,V the front holds for the requests and the prefix cache, in blocks of 16 positions: a "
                   "prompt is admitted where its blocks are free, a decode that finds none preempts the request "
                   "that arrived last (it runs again from its prompt; vllm:num_preemptions counts them), and a "
                   "request that could never fit is refused (400). Default: VLLM_CPU_KVCACHE_SPACE where set, "
                   "else 40% of the memory free at start. Said at start; vllm:kv_cache_usage_perc shows its use.")
@click.option("--degree", default="auto", show_default=True,
              help="Ranks per prefill: auto (one rank below the measured or predicted crossover, the chain above), "
                   "1, or the world size.")
@click.option("--learn", default="auto", show_default=True,
              help="With --degree auto: correct the choice by the TTFTs this server measures (per layout and "
                   "length bucket, a bounded share of requests exploring; kvrunahead.degree_source says which). "
                   "auto: kept across restarts in the cache folder, one file per setting; a path: kept there; "
                   "off: the tables' or the cost model's choice alone. kvr-learned shows and exports them.")
@click.option("--partition", default="auto", show_default=True,
              help="The chain's partition, as kvr-prefill's: auto, table, even, boundaries or ratios.")
@click.option("--table", type=click.Path(exists=True, dir_okay=False), help="Partition table to use.")
@common.kvr_attention_option(help="The chain's attention, as kvr-prefill's: auto, split or masked.")
@common.net_option(help="The network label (and with --nproc, its emulation), as kvr-prefill's.")
@common.timeout_option(60.0, help="Seconds a rank waits on another before the server fails (and exits 1).")
@click.option("--restarts", type=int, default=0, show_default=True,
              help="Start the whole server again (every rank, on the same --host and --port) after it ends with an "
                   "error (a rank died, stopped or was cut off), up to this many times; the requests in flight "
                   "when it ended get an error. Not under torchrun (its --max-restarts does this) or mpirun.")
@click.option("--recover/--no-recover", default=True, show_default=True,
              help="With --nproc (whole-model ranks, no --tp): when a worker rank dies, stops past --timeout or is "
                   "cut off, the front serves on: the decodes whose K,V it holds keep streaming, the other "
                   "requests wait or run again from their prompts (kvrunahead.retried), and the workers are "
                   "started again and joined (/health says degraded meanwhile; kvr_degraded, "
                   "kvr_rank_restarts_total). --no-recover: the server ends (exit 1), for --restarts or a "
                   "supervisor to start again.")
@click.option("--grace", "grace_s", type=float, default=30.0, show_default=True,
              help="After SIGTERM: seconds the requests in flight get to finish before they are ended.")
@common.tp_option()
@common.dtype_option()
@common.attention_kernel_option()
@common.linears_option()
@common.compile_option()
@common.device_option()
@click.option("--threads", type=int, default=None, help="Intra-op threads per rank. Default: cores / local ranks.")
@common.allow_long_context_option(help="Run beyond the trained positions without a RoPE extension.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic presets' weights.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress and every request to stderr.")
def main(nproc: int, host: str, port: int, grace_s: float, verbose: bool, **options) -> None:
    """Serve a model over HTTP with the OpenAI API; long prompts are prefilled by KV-Runahead over the ranks.

    \b
      kvr-serve --nproc 2 --port 8000
      torchrun --nproc-per-node 2 --no-python kvr-serve
      mpirun -n 2 kvr-serve
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8}'
    """
    common.quiet(verbose)
    from kvrunahead.config import RunConfig
    from kvrunahead.decide.policy import network_spec
    from kvrunahead.ranks.launcher import detect_launcher, world_size_hint

    launcher = detect_launcher()
    with common.failure_ending(PROG, rank=common.env_rank(), reraise=verbose):
        if grace_s < 0:
            raise InputError(f"--grace must be >= 0, got {grace_s}")
        world_size = world_size_hint(launcher, nproc)
        common.check_nproc(nproc, launcher, world_size)
        net = network_spec(RunConfig(net=options["net"]))
        restarts = options.pop("restarts")
        recover = options.pop("recover")
        if restarts < 0:
            raise InputError(f"--restarts must be 0 or more, got {restarts}")
        if restarts and launcher != "single":
            raise InputError(f"--restarts is for the ranks kvr-serve starts itself; under {launcher} give its own "
                             "restart policy (torchrun --max-restarts N)")
        if launcher == "single":
            check_listen(host, port)
            check(options, world_size)
            if restarts and port == 0:
                raise InputError("--restarts needs a --port of its own: a restarted server on another free port "
                                 "would not be found")
            if nproc > 1 or restarts:
                front = nproc - 1 if recover and nproc > 1 and options["tp"] == 1 else None
                from kvrunahead.ranks.launcher import spawn_restarting
                from kvrunahead.serve import engine  # noqa: F401  (imported once here, the forked ranks share it)
                from kvrunahead.serve.http import app  # noqa: F401

                # the ranks get the grace to drain, and a failed rank's peers get --timeout to notice it
                sys.exit(spawn_restarting(nproc, sys.argv[1:], restarts, max(5.0, options["timeout_s"] + 5.0),
                                          "kvrunahead.cli.serve", net, front, fork=True))
            if net.emulated:
                raise InputError("--net cap=... emulates one host per rank: give --nproc 2 or more")
        run_rank(options, launcher, host, port, grace_s, verbose)


if __name__ == "__main__":
    main()

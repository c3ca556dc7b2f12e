"""``kvr-serve``'s options checked before any rank starts (one line, exit 2), and the engine's config made of them."""

from __future__ import annotations

import socket

from kvrunahead.errors import InputError


def check_listen(host: str, port: int) -> None:
    """Fail before any rank loads a model when the address cannot be listened on (a port in use)."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be 0..65535, got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def check(options: dict, world_size: int) -> None:
    """The input checks every rank would fail alike, made once before the ranks start (one line, exit 2)."""
    from kvrunahead.decide.policy import tp_groups
    from kvrunahead.model.device import check_device
    from kvrunahead.model.load import ModelError, resolve_config
    from kvrunahead.model.rope import ContextError
    from kvrunahead.serve import learning
    from kvrunahead.serve.degree import learned_folder, parse_degree

    if (options["ssl_keyfile"] is None) != (options["ssl_certfile"] is None):
        raise InputError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
    if options["ssl_certfile"] is not None:
        import ssl

        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(options["ssl_certfile"], options["ssl_keyfile"])
        except (ssl.SSLError, OSError) as e:
            raise InputError(f"--ssl-certfile/--ssl-keyfile do not load as a PEM certificate and its key: {e}") \
                from None
    if options["api_key"] is not None and not options["api_key"].strip():
        raise InputError("--api-key is empty: give a key, or leave the option out to serve without one")
    if options["max_queue"] < 1:
        raise InputError(f"--max-queue must be at least 1, got {options['max_queue']}")
    if options["max_request_bytes"] < 1:
        raise InputError(f"--max-request-bytes must be at least 1, got {options['max_request_bytes']}")
    if options["prefill"] != "spp" and (options["stages"].strip() != "auto" or options["spp_chunk_tokens"]):
        raise InputError("--stages and --spp-chunk-tokens apply to --prefill spp")
    if options["prefill"] == "spp" and options["decode"] == "kvp":
        raise InputError("--prefill spp gathers every stage's K,V on the front, which decodes: --decode kvp needs "
                         "the chain's prefill (its parts stay where they were made)")
    if options["kv_cache_memory"] is not None and options["kv_cache_memory"] <= 0:
        raise InputError(f"--kv-cache-memory must be a positive number of GiB, got {options['kv_cache_memory']}")
    for name in ("pack_tokens", "prefix_cache_tokens", "step_budget_ms", "chunk_tokens", "spp_chunk_tokens"):
        if options[name] < 0:
            raise InputError(f"--{name.replace('_', '-')} must be 0 (off) or more, got {options[name]}")
    check_device(options["device"])
    config = engine_config(options)
    groups = tp_groups(config.run, world_size)  # a bad TP shape: one line, before any rank loads weights
    try:
        parse_degree(options["degree"], groups)
        learning.check_path(options["learn"], learned_folder())
        if options["table"] is not None:  # a table that does not read fails here, not at the first long prompt
            from kvrunahead.decide.tables import Table

            Table.load(options["table"])
        model_config = resolve_config(options["model"])
        _check_kv_cache(config, model_config, options["device"])
    except (ModelError, ContextError, ValueError) as e:
        raise InputError(str(e)) from None
    _check_scheduling(options, model_config)
    if options["prefill"] == "spp":
        from dataclasses import replace

        from kvrunahead.decide.policy import plan_stages
        from kvrunahead.model.stage import check_stageable

        try:
            check_stageable(model_config)
        except NotImplementedError as e:
            raise InputError(str(e)) from None
        plan_stages(replace(config.run, mode="spp", stages=options["stages"]), model_config, 2 * world_size,
                    world_size, world_size)
    if options["decode"] == "kvp":
        from kvrunahead.decode.kvp import check_kvp

        try:
            check_kvp(model_config)
        except NotImplementedError as e:
            raise InputError(f"--decode kvp cannot serve {options['model']}: {e}") from None


def _check_kv_cache(config, model_config, device: str | None) -> None:
    """The longest request within the K,V pool (on a CPU: a GPU's free memory is known on its rank)."""
    import torch

    from kvrunahead.model.device import DTYPES, dtype_name
    from kvrunahead.serve.config import model_len_limit
    from kvrunahead.serve.kv_pool import env_gib, pool_for

    limit = model_len_limit(config.run, model_config, config.max_model_len)
    env_gib()  # a bad VLLM_CPU_KVCACHE_SPACE named on every device
    if device == "cpu" or (device in (None, "auto") and not torch.cuda.is_available()):
        size = DTYPES[dtype_name(config.run.dtype, "cpu")].itemsize
        pool_for(config.kv_cache_memory_gib, model_config, size, config.run.tp, limit)


def _check_scheduling(options: dict, model_config) -> None:
    """Chunked prefill and LARS price prefills with the CPU cost model, and run full-attention models only (a
    sliding layer keeps its window, not the positions a later chunk reads back)."""
    from kvrunahead.model.layout import layer_windows

    wanted = [name for name, on in (("--step-budget-ms", options["step_budget_ms"] > 0),
                                    ("--chunk-tokens", options["chunk_tokens"] > 0),
                                    ("--schedule lars", options["schedule"] == "lars")) if on]
    if not wanted:
        return
    if any(w is not None for w in layer_windows(model_config)):
        raise InputError(f"{', '.join(wanted)}: chunked prefill and LARS run full-attention models only, and "
                         f"{options['model']} has sliding-window layers")
    if options["device"] not in (None, "auto", "cpu") or options["ttft_slo_s"] <= 0 or options["ttft_slo_factor"] <= 0:
        raise InputError(f"{', '.join(wanted)}: the cost model prices CPU ranks only, and --ttft-slo-s and "
                         f"--ttft-slo-factor must be positive")


def engine_config(options: dict):
    from kvrunahead.config import RunConfig
    from kvrunahead.serve.config import EngineConfig

    run = RunConfig(model=options["model"], partition=options["partition"], kvr_attention=options["kvr_attention"],
                    table=options["table"], dtype=options["dtype"], compile=options["compile"],
                    device=options["device"], threads=options["threads"], timeout_s=options["timeout_s"],
                    net=options["net"], seed=options["seed"], allow_long_context=options["allow_long_context"],
                    context_len=None, decode=options["decode"], tp=options["tp"])
    return EngineConfig(run=run, max_queue=options["max_queue"], max_model_len=options["max_model_len"],
                        kv_cache_memory_gib=options["kv_cache_memory"],
                        degree=options["degree"], learn=options["learn"], pack_tokens=options["pack_tokens"],
                        prefix_cache_tokens=options["prefix_cache_tokens"], step_budget_ms=options["step_budget_ms"],
                        chunk_tokens=options["chunk_tokens"], schedule=options["schedule"],
                        ttft_slo_s=options["ttft_slo_s"], ttft_slo_factor=options["ttft_slo_factor"],
                        mixed_steps=options["mixed_steps"], prefill=options["prefill"], stages=options["stages"],
                        spp_chunk_tokens=options["spp_chunk_tokens"])

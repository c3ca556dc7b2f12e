"""kvr-kernels: build kvrunahead's CPU kernels now (they are otherwise built on first use) and say what runs."""

from __future__ import annotations

import logging
import sys

import click

from kvrunahead.cli import common


@click.command(context_settings=common.SETTINGS)
@click.option("--verbose", is_flag=True, help="Show the compiler's commands.")
def main(verbose: bool) -> None:
    """Compile the CPU attention kernel into the cache folder (~/.cache/kvrunahead/kernels, or KVR_CACHE), once per
    machine and torch version, and print the instruction set it runs with here; time its two paths for prefill
    rows (the tiles and the vector path) and it against torch's attention in float32 and bfloat16 (once per
    build), and print the rates, the path it takes and what --attention-kernel auto runs; time the linear layers
    packed for oneDNN against F.linear (once per machine and torch version) and print what --linears auto runs.
    Exit 1 where the kernel cannot be built (the tools then run torch's attention)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from kvrunahead import kernels

    if not kernels.build(verbose=verbose):
        click.echo(f"kvr-kernels: the CPU attention kernel could not be built: {kernels.why_not_built()}", err=True)
        sys.exit(1)
    click.echo(f"CPU attention kernel: {kernels.isa()} ({kernels.cache_dir()})")
    picks = kernels.auto_choice()  # first: it sets the faster of the kernel's paths in each dtype
    for dtype in kernels.DTYPES:
        pick = picks.get(dtype, {})
        timed = (f" (prefill rows: tiles {pick['tiles_gflops']:.1f}, vector path {pick['vector_gflops']:.1f} "
                 "GFLOP/s)" if "tiles" in pick else "")
        click.echo(f"  {dtype:9} prefill rows take the {kernels.path(dtype)} path{timed}")
    for dtype, pick in picks.items():
        click.echo(f"  {dtype:9} ours {pick['ours_gflops']:7.1f} GFLOP/s, torch's {pick['torch_gflops']:7.1f} GFLOP/s: "
                   f"--attention-kernel auto runs {pick['kernel']}")
    if kernels.chosen() != "auto":
        click.echo(f"  ({kernels.ENV}={kernels.chosen()} overrides the choice)")
    from kvrunahead.model import linears

    for dtype, pick in linears.auto_choice().items():
        click.echo(f"  {dtype:9} linears: oneDNN packed {pick['onednn_gflops']:7.1f} GFLOP/s, F.linear "
                   f"{pick['torch_gflops']:7.1f} GFLOP/s: --linears auto runs {pick['linears']}")
    from kvrunahead.model.device import fast_dtype

    click.echo(f"  --dtype auto computes in {fast_dtype('cpu')} (the faster GEMMs where the CPU has bfloat16 "
               "instructions)")


if __name__ == "__main__":
    main()

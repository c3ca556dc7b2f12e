"""Emulated hosts on this machine (one network namespace each, links rate-capped each way) for jobs that start
their own ranks, such as one torchrun per host. Needs root.

\b
  kvr-net run --hosts 2 --net cap=400MB/s -- torchrun --nnodes 2 --nproc-per-node 1 \\
      --rdzv-backend c10d --rdzv-endpoint {addr0}:29400 --rdzv-conf is_host={is_host0} \\
      --local-addr {addr} --no-python kvr-prefill --net cap=400MB/s --ctx 2k --verify
  kvr-net up --hosts 2 --net cap=13MB/s     # and leave it up
  kvr-net list
  kvr-net down                              # remove every emulated host and link
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys

import click

from kvrunahead.cli import common
from kvrunahead.net.emulation import IFNAME, Emulation, leftovers, teardown_all
from kvrunahead.net.session import network
from kvrunahead.net.spec import NetError, parse_net
from kvrunahead.ranks.supervise import supervise

PROG = "kvr-net"


@click.group(context_settings=common.SETTINGS, help=__doc__)
def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="kvr-net: %(message)s")


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--hosts", type=int, default=2, show_default=True, help="Emulated hosts (network namespaces).")
@click.option("--net", "net_text", default="cap=400MB/s", show_default=True,
              help="Link cap each way, and ',noise' for the noise sidecar between random adjacent hosts.")
@click.option("--grace", type=float, default=10.0, show_default=True,
              help="Seconds the other hosts' commands get to end on their own after one fails.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(hosts: int, net_text: str, grace: float, command: tuple[str, ...]) -> None:
    """Run COMMAND once on every emulated host, then remove the hosts (on every exit, Ctrl-C included).

    COMMAND may use the placeholders {host} (this host's index), {addr} (its address), {addr0} (host 0's
    address), {hosts} (how many), {is_host0} (1 on host 0, else 0: torchrun's rdzv-conf is_host, as the hosts
    share one hostname); GLOO_SOCKET_IFNAME, KVR_HOST and KVR_ADDR0 are set in its environment.
    Exits with the first non-zero exit code of the commands.
    """
    try:
        spec = parse_net(net_text)
        if not spec.emulated:
            raise NetError("kvr-net run emulates hosts: give --net cap=RATE (loopback needs no emulation)")
        with network(spec, hosts) as h:
            procs = []
            for host in range(hosts):
                subst = {"host": str(host), "addr": h.address(host), "addr0": h.master_addr, "hosts": str(hosts),
                         "is_host0": "1" if host == 0 else "0"}
                argv = [arg.format(**subst) for arg in command]
                env = dict(os.environ, **h.env, KVR_HOST=str(host), KVR_ADDR0=h.master_addr)
                click.echo(f"kvr-net: host {host} ({h.address(host)}): {shlex.join(argv)}", err=True)
                procs.append(subprocess.Popen(h.prefix(host) + argv, env=env))
            code = supervise(procs, grace_s=grace)
            if h.noise is not None and (report := h.noise.stop()) is not None:
                click.echo(f"kvr-net: {report.describe()}", err=True)
    except (NetError, KeyError) as e:
        common.fail(PROG, str(e))
    sys.exit(code)


@main.command()
@click.option("--hosts", type=int, default=2, show_default=True)
@click.option("--net", "net_text", default="cap=400MB/s", show_default=True, help="Link cap each way (no noise).")
def up(hosts: int, net_text: str) -> None:
    """Create emulated hosts and leave them up; prints how to use and remove them."""
    with common.failure_ending(PROG):
        spec = parse_net(net_text)
        if spec.noise:
            raise NetError("kvr-net up makes the hosts only; the noise sidecar runs with kvr-net run")
        emu = Emulation(hosts, spec.cap_bytes_per_s).setup()
    click.echo(emu.describe())
    click.echo(f"run on host 0: {shlex.join(emu.exec_prefix(0))} env GLOO_SOCKET_IFNAME={IFNAME} COMMAND")
    click.echo("remove: kvr-net down")


@main.command()
def down() -> None:
    """Remove every emulated host and link of this project, whichever run made them."""
    with common.failure_ending(PROG):
        removed = teardown_all()
    click.echo("\n".join(f"removed {x}" for x in removed) or "nothing to remove")


@main.command(name="list")
def list_() -> None:
    """The emulated hosts and links of this project that exist now."""
    click.echo("\n".join(leftovers()) or "none")


if __name__ == "__main__":
    main()

"""Peak host memory of one split-attention call, in a process of its own: the high-water mark of its resident set
(VmHWM), reset just before the call. Not ``ru_maxrss``: Linux carries that over from the parent across the
fork and exec that start this process, so a large parent (a pytest that collected every test) raised it.

Usage: python tests/attention_memory_probe.py CONTEXT PART  ->  prints JSON {"peak_extra_bytes", "need_bytes"}
The shapes are SmolLM2-135M's (9 query heads, 3 K,V heads of 64), float32, two threads: the last rank's layer when
``PART`` of ``CONTEXT`` tokens are its own and the rest its prefix.
"""

import json
import resource
import sys

import torch

from kvrunahead import kernels
from kvrunahead.kernels import attention as kernel
from kvrunahead.modes.kvr import split_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


def reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the resident set's high-water mark back to the current size (Linux 4.0)


def high_water_bytes() -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def inputs(context: int, part: int):
    # The layout the model hands over: queries [1, part, heads, dim] transposed to heads first.
    q = torch.randn(1, part, HEADS, HEAD_DIM).transpose(1, 2)
    return q, torch.randn(1, KV_HEADS, context, HEAD_DIM), torch.randn(1, KV_HEADS, context, HEAD_DIM)


def need_bytes(context: int, part: int) -> int:
    """What the blocks need at once, float32. torch's kernels: the diagonal block's K,V repeated to the query heads
    and its output (3 outputs' worth), then the prefix block's grouped queries and output beside the diagonal output
    it merges into (3 again), with two log-sum-exp rows. Ours (kvrunahead/kernels): its output and log-sum-exp,
    every block's scratch within a few hundred kB per thread, and on its tile path one K,V head's keys and values
    packed in blocks of 64 (one head at a time)."""
    if kernel.usable(torch.empty(0)):
        packed = 2 * -(-context // 64) * 64 * HEAD_DIM * 4 if kernels.path("float32") in ("amx", "brgemm") else 0
        return (part * HEADS * HEAD_DIM + part * HEADS) * 4 + packed
    return (3 * part * HEADS * HEAD_DIM + 2 * part * HEADS) * 4


def main() -> None:
    context, part = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    split_attention(None, *inputs(64, 16), None, scaling=HEAD_DIM**-0.5)  # the kernels' code pages, loaded once
    q, k, v = inputs(context, part)
    base = rss_bytes()
    reset_high_water()
    split_attention(None, q, k, v, None, scaling=HEAD_DIM**-0.5)
    peak = high_water_bytes()
    print(json.dumps({"peak_extra_bytes": peak - base, "need_bytes": need_bytes(context, part)}))


if __name__ == "__main__":
    main()

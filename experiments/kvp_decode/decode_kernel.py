"""Time the decode attention kernel (one new token over each layer's cache, ``kvr-calibrate``'s measure_decode) on
this machine and write it into an existing profile, leaving its other figures as they were: how the shipped CPU
profiles got their decode kernel without a whole recalibration (which would also replace their links to the capped
networks, measured on another day).

Usage: python experiments/kvp_decode/decode_kernel.py --threads 1 kvrunahead/sim/profiles/cpu-t1.json
"""

from __future__ import annotations

import argparse
import datetime
import logging
from pathlib import Path

import torch

from kvrunahead.calibrate.calibrate import DECODE_KEYS, measure_decode
from kvrunahead.model.load import load_model, resolve_config
from kvrunahead.provenance import environment
from kvrunahead.sim.profile import HardwareProfile
from kvrunahead.sim.shape import shape_from_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, help="profile JSON to add the decode kernel to (rewritten in place)")
    ap.add_argument("--threads", type=int, required=True, help="threads, as the profile's")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    profile = HardwareProfile.load(args.profile)
    if profile.threads != args.threads:
        ap.error(f"{args.profile} is a {profile.threads}-thread profile, not {args.threads}")
    torch.set_num_threads(args.threads)
    shape = shape_from_config(resolve_config(args.model), profile.dtype, args.model)
    model = load_model(args.model, getattr(torch, profile.dtype), torch.device("cpu")).model
    kernel, worst = measure_decode(model, shape, args.repeats)
    profile.attention["decode"] = kernel
    profile.fit["attention_decode"] = round(worst, 4)
    env = environment(args.model, "torch", args.threads, "loopback")
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    profile.sources["attention_decode"] = (f"experiments/kvp_decode/decode_kernel.py on {args.model} at "
                                           f"{', '.join(map(str, DECODE_KEYS))} keys, {env['cpu']}, "
                                           f"{args.threads} thread(s), {when}")
    profile.save(args.profile)
    print(f"{args.profile}: decode kernel {kernel.call_s * 1e3:.3f} ms per call + {kernel.flops_per_s:.3g} FLOP/s "
          f"(worst residual {100 * worst:.1f}%)")


if __name__ == "__main__":
    main()

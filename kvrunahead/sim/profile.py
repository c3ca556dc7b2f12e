"""Hardware profiles: what one rank's device and its links deliver, as the cost model reads them.

A profile is plain JSON. ``kvr-calibrate`` measures one on the local device (each figure fitted to
microbenchmarks of the runtime's own model code and kernels); the built-in GPU profiles are public peak
figures times efficiency factors, every factor with where it comes from (``sources``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrunahead.errors import ProfileError
from kvrunahead.net.spec import NetError, parse_net

KERNELS = ("causal", "full", "masked")  # every profile has these; "decode" (one query over a cache) is optional


@dataclass(frozen=True)
class AttentionCost:
    """One attention kernel: a fixed cost per call, per query row (output, log-sum-exp merge), per key (K,V
    head expansion for GQA, mask) and the FLOP rate on the query-key pairs it computes. ``skips_masked``:
    whether a causal diagonal block costs half of its square (flash kernels) or all of it (eager attention
    materialises every score). ``score_bytes``: memory traffic per score and query head, for kernels bound by
    it (eager attention writes, masks, soft-maxes and reads every score); 0 for fused kernels. ``pair_growth_s``:
    seconds more per pair for each doubling of the keys past ``GROWTH_FROM_KEYS``, for a kernel whose pairs cost
    more as its rectangle outgrows the caches (the explicit-mask SDPA on CPU: about 10% more per pair at 8k x 16k
    than at 1k x 1k); 0 for the others."""

    flops_per_s: float
    score_bytes: float = 0.0
    call_s: float = 0.0
    query_s: float = 0.0
    key_s: float = 0.0
    skips_masked: bool = True
    pair_growth_s: float = 0.0


GROWTH_FROM_KEYS = 256  # the smallest keys of kvr-calibrate's shapes: no growth term below


def key_doublings(keys: float) -> float:
    """How many times ``keys`` doubles past ``GROWTH_FROM_KEYS`` (0 below it): ``AttentionCost.pair_growth_s``'s
    multiplier per pair."""
    return math.log2(keys / GROWTH_FROM_KEYS) if keys > GROWTH_FROM_KEYS else 0.0


@dataclass(frozen=True)
class LinkProfile:
    """One direction of one link between adjacent ranks: ``latency_s + bytes / bandwidth_Bps`` per message.
    ``allgather``: 'ring' (p-1 steps of point-to-point transfers, what the runtime uses on gloo and MPI) or
    'native' (a collective whose bytes move at ``allgather_efficiency`` times the link's rate).
    ``compute_s_per_byte``: on one host the transfers' copies run on the cores that compute (0 on a GPU node)."""

    bandwidth_Bps: float
    latency_s: float = 0.0
    allgather: str = "ring"
    allgather_efficiency: float = 1.0
    compute_s_per_byte: float = 0.0  # compute a rank loses per byte it sends or receives (copies on its cores)


@dataclass
class HardwareProfile:
    name: str
    device: str
    matmul_flops_per_s: float  # projections and MLP, at large token counts
    matmul_half_tokens: float  # tokens at which a projection reaches half that rate (0: flat)
    memory_Bps: float  # copies (cache concatenation, gather reassembly) and the one-token LM head read
    layer_s: float  # fixed cost of one decoder layer's forward (launches, norms, rotary, Python)
    attention: dict[str, AttentionCost]
    links: dict[str, LinkProfile]  # by network label ("loopback", "cap=650MB/s", "nvlink")
    default_link: str
    threads: int = 1
    dtype: str = "float32"
    device_kind: str = "cpu"  # "cpu" or "cuda": which partition tables a model-backed search writes
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    versions: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # where each figure comes from
    fit: dict[str, float] = field(default_factory=dict)  # calibration: worst relative residual per step

    def __post_init__(self) -> None:
        missing = [k for k in KERNELS if k not in self.attention]
        if missing:
            raise ProfileError(f"profile {self.name!r} lacks attention kernels {missing}")
        if self.default_link not in self.links:
            raise ProfileError(f"profile {self.name!r}: default link {self.default_link!r} is not among "
                               f"{sorted(self.links)}")

    def link(self, label: str | None = None) -> LinkProfile:
        label = label or self.default_link
        if label not in self.links:
            raise ProfileError(f"profile {self.name!r} has no link {label!r}; it has {sorted(self.links)} "
                               f"(kvr-calibrate --net measures one)")
        return self.links[label]

    def for_network(self, label: str | None) -> tuple[HardwareProfile, str, str]:
        """This profile with a link for the network ``label`` (a partition table's network label: ``loopback``,
        ``cap=400MB/s``), the link's label and a line saying where its figures come from: the link measured on
        that network; for a cap not measured, the measured cap nearest in rate rescaled to it (its overshoot of
        the nominal rate, all-gather efficiency and compute per byte kept: tbf caps scale); else the default."""

        if label is None or label in self.links:
            used = label or self.default_link
            return self, used, f"link {used}"

        def cap_of(text: str) -> float | None:
            try:
                return parse_net(text).cap_bytes_per_s
            except NetError:
                return None

        cap = cap_of(label)
        measured = {rate: name for name in self.links if (rate := cap_of(name)) is not None}
        if cap is None or not measured:
            return self, self.default_link, f"link {self.default_link} (the profile measured none for {label})"
        nominal = min(measured, key=lambda rate: abs(math.log(rate / cap)))
        near = self.links[measured[nominal]]
        link = dataclasses.replace(near, bandwidth_Bps=near.bandwidth_Bps * cap / nominal)
        return (dataclasses.replace(self, links={**self.links, label: link}), label,
                f"link {label} (the measured {measured[nominal]} rescaled)")

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        try:
            data = dict(data)
            data["attention"] = {k: AttentionCost(**v) for k, v in data["attention"].items()}
            data["links"] = {k: LinkProfile(**v) for k, v in data["links"].items()}
            profile = cls(**data)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ProfileError(f"malformed profile: {e}") from None
        rates = [profile.matmul_flops_per_s, profile.memory_Bps, *(k.flops_per_s for k in profile.attention.values()),
                 *(link.bandwidth_Bps for link in profile.links.values())]
        if not all(isinstance(r, (int, float)) and r > 0 for r in rates):
            raise ProfileError(f"profile {profile.name!r} has a rate that is not positive")
        return profile

    @classmethod
    def load(cls, path: Path) -> HardwareProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read profile {path}: {e}") from None
        return cls.from_dict(data)


# Public figures for the built-in GPU profiles. Peak dense fp16/bf16 tensor throughput and HBM bandwidth are
# NVIDIA's data-sheet numbers; NVLink per direction is half the quoted bidirectional total.
_A100 = {"peak_flops": 312e12, "hbm_Bps": 2.0e12, "nvlink_Bps": 300e9, "ib_Bps": 25e9}
_H100 = {"peak_flops": 989e12, "hbm_Bps": 3.35e12, "nvlink_Bps": 450e9, "ib_Bps": 50e9}
IB_LATENCY_S = 5e-6  # one InfiniBand message between nodes (a few microseconds; NCCL over IB verbs)

# Efficiency factors, set once for every built-in profile (never per model or per cell). The three marked
# "fitted" are least squares on the paper's single-GPU column (appendix B table 3: Llama-7B, 1k-12k, one A100;
# experiments/sim_validation/paper.py), so that no multi-GPU cell takes part in setting them.
MATMUL_EFFICIENCY = 0.66  # fitted; large cuBLAS GEMMs reach 60-80% of tensor peak (NVIDIA's GEMM guide)
FLASH_EFFICIENCY = 0.50  # FlashAttention-2 forward: 50-73% of A100 peak (Dao 2023, fig. 4); H100 FA2 ~35-50%
MEMORY_EFFICIENCY = 0.80  # STREAM-like copies reach ~80% of HBM peak
LINK_EFFICIENCY = 0.80  # NCCL bus bandwidth on NVLink: ~80% of the link's rate (nccl-tests on DGX A100)
LINK_LATENCY_S = 10e-6  # one NCCL point-to-point message on a node (nccl-tests small-message times)
# The paper ran Hugging Face Llama/Falcon with PyTorch 2.0 eager attention: every score of the q x k matrix is
# written, masked, soft-maxed in float32 and read back. It is bound by HBM traffic, about 30 bytes per score
# (fp16 QK^T write 2, mask add 2+2, fp32 upcast 4+4, softmax 4+4, fp16 cast 4+2, AV read 2); fitted: 29.4.
EAGER_BYTES_PER_SCORE = 29.4
# Per-layer fixed cost (launches, Python) in eager mode; fitted: the single-GPU column shows none.
EAGER_LAYER_S = 0.0


def _gpu(name: str, fig: dict, link_name: str, link_Bps: float, attention: str, layer_s: float,
         sources: dict[str, str], matmul_efficiency: float, eager_bytes: float) -> HardwareProfile:
    matmul = fig["peak_flops"] * matmul_efficiency
    memory = fig["hbm_Bps"] * MEMORY_EFFICIENCY
    if attention == "flash":
        kernel = AttentionCost(flops_per_s=fig["peak_flops"] * FLASH_EFFICIENCY, call_s=20e-6)
        kernels = {"causal": kernel, "full": kernel,
                   # masked SDPA calls fall back to the memory-efficient kernel with an explicit mask
                   "masked": AttentionCost(flops_per_s=fig["peak_flops"] * FLASH_EFFICIENCY / 2, call_s=20e-6,
                                           skips_masked=False)}
    else:  # eager: two GEMMs plus HBM traffic for every score
        kernels = {k: AttentionCost(flops_per_s=matmul, score_bytes=eager_bytes, call_s=20e-6,
                                    skips_masked=False) for k in KERNELS}
    links = {link_name: LinkProfile(link_Bps * LINK_EFFICIENCY, LINK_LATENCY_S, "native", 1.0),
             # between nodes: each GPU's own InfiniBand NIC (DGX A100: 8 x HDR 200 Gb/s; DGX H100: 8 x NDR 400 Gb/s)
             "ib": LinkProfile(fig["ib_Bps"] * LINK_EFFICIENCY, IB_LATENCY_S, "native", 1.0)}
    return HardwareProfile(name=name, device=name.split("-")[0].upper(), matmul_flops_per_s=matmul,
                           matmul_half_tokens=256.0, memory_Bps=memory, layer_s=layer_s, attention=kernels,
                           links=links, default_link=link_name, dtype="float16", device_kind="cuda",
                           date="public figures", sources=sources)


_SOURCES = {
    "peak": "NVIDIA A100/H100 data sheets: dense fp16/bf16 tensor peak, HBM bandwidth, NVLink total / 2",
    "matmul_efficiency": "fitted to the paper's single-GPU column; large cuBLAS GEMMs reach 60-80% of peak "
                         "(NVIDIA Matrix Multiplication Background guide)",
    "matmul_half_tokens": "256: GEMMs with fewer rows than this are bound by reading the weights",
    "memory_efficiency": f"{MEMORY_EFFICIENCY}: STREAM-like copy on HBM",
    "link_efficiency": f"{LINK_EFFICIENCY}: nccl-tests bus bandwidth over NVLink on DGX systems",
    "link_latency_s": f"{LINK_LATENCY_S}: nccl-tests small messages within a node",
    "ib": "between nodes, one InfiniBand NIC per GPU (DGX A100 HDR 200 Gb/s, DGX H100 NDR 400 Gb/s data sheets) at "
          f"the same efficiency, {IB_LATENCY_S} s a message",
}


def builtin_profiles(matmul_efficiency: float = MATMUL_EFFICIENCY, eager_bytes: float = EAGER_BYTES_PER_SCORE,
                     eager_layer_s: float = EAGER_LAYER_S) -> dict[str, HardwareProfile]:
    """The built-in GPU profiles; the three fitted globals can be given (experiments/sim_validation/paper.py
    fits them)."""
    eager = {**_SOURCES, "attention": f"eager (PyTorch 2.0 Hugging Face, as the paper): {eager_bytes} "
             "HBM bytes per score, matmul efficiency and layer_s fitted once to the paper's single-GPU column "
             "(experiments/sim_validation/paper.py)"}
    fitted = (matmul_efficiency, eager_bytes)
    flash = {**_SOURCES, "attention": f"FlashAttention-2 class kernels at {FLASH_EFFICIENCY} of peak (Dao 2023); "
             "masked calls at half that and computing every pair", "layer_s": "CUDA-graph-free eager launch cost"}
    return {
        # The paper's testbed (section 5): 8 x A100 with NVLink (300 GB/s) or without it (10 GB/s).
        "a100-nvlink": _gpu("a100-nvlink", _A100, "nvlink", 300e9, "eager", eager_layer_s, eager, *fitted),
        "a100-pcie": _gpu("a100-pcie", _A100, "pcie", 10e9, "eager", eager_layer_s, eager, *fitted),
        "a100-nvlink-flash": _gpu("a100-nvlink-flash", _A100, "nvlink", 300e9, "flash", 0.3e-3, flash, *fitted),
        "h100-nvlink": _gpu("h100-nvlink", _H100, "nvlink", 450e9, "flash", 0.3e-3, flash, *fitted),
    }


SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"  # calibrated profiles that ship with the package


def local_profile_path(threads: int = 1) -> Path:
    """Where ``kvr-calibrate`` writes this machine's profile by default."""
    from kvrunahead.config import cache_root

    return cache_root() / "profiles" / f"cpu-t{threads}.json"


def resolve_profile(name_or_path: str | None, threads: int = 1) -> tuple[HardwareProfile, str]:
    """A profile and a line saying which: a file, a built-in GPU profile, or (None) this machine's CPU
    profile from ``kvr-calibrate``, else the CPU profile shipped with the package (measured elsewhere)."""
    builtins = builtin_profiles()
    if name_or_path is None or name_or_path == "cpu":
        local = local_profile_path(threads)
        if local.exists():
            return HardwareProfile.load(local), f"this machine's profile {local}"
        shipped = SHIPPED_DIR / f"cpu-t{threads}.json"
        if not shipped.exists():
            raise ProfileError(f"no CPU profile for {threads} thread(s) per rank: run kvr-calibrate --threads "
                               f"{threads}")
        profile = HardwareProfile.load(shipped)
        return profile, (f"the shipped CPU profile ({profile.device}, {profile.date[:10]}); run kvr-calibrate "
                         "to measure this machine")
    if name_or_path in builtins:
        return builtins[name_or_path], f"built-in profile {name_or_path} (public figures)"
    measured = SHIPPED_DIR / f"{name_or_path}.json"
    if measured.exists() and "/" not in name_or_path:  # a GPU profile measured by experiments/gpu/campaign.sh
        profile = HardwareProfile.load(measured)
        return profile, f"the shipped profile {name_or_path} (measured on {profile.device}, {profile.date[:10]})"
    if Path(name_or_path).exists():
        return HardwareProfile.load(Path(name_or_path)), f"profile {name_or_path}"
    raise ProfileError(f"no profile {name_or_path!r}: use one of cpu, {', '.join(builtins)} or a file written by "
                       f"kvr-calibrate")


def keep_builtin_links(profile: HardwareProfile) -> None:
    """A GPU profile measured on one GPU takes its links from the built-in profile of its GPU's family (NVLink
    figures from the data sheet: one GPU has no peer to measure a link against), and says so."""
    family = "a100-nvlink" if "A100" in profile.device.upper() else "h100-nvlink"
    base = builtin_profiles()[family]
    profile.links, profile.default_link = dict(base.links), base.default_link
    profile.sources["links"] = f"not measured (one GPU): the built-in {family} profile's, {base.sources['peak']}"


def describe_profile(profile: HardwareProfile) -> str:
    """The profile in a few lines: its compute, attention and link figures, and the fit's worst residual."""
    lines = [f"profile {profile.name}: {profile.device}, {profile.threads} thread(s), {profile.dtype}",
             f"  projections/MLP {profile.matmul_flops_per_s / 1e9:.1f} GFLOP/s, layer overhead "
             f"{profile.layer_s * 1e3:.2f} ms, copies {profile.memory_Bps / 1e9:.1f} GB/s"]
    for name, k in profile.attention.items():
        growth = f", +{k.pair_growth_s * 1e9:.2f} ns per pair per key doubling" if k.pair_growth_s else ""
        lines.append(f"  attention {name:<6} {k.flops_per_s / 1e9:.1f} GFLOP/s on the pairs it computes, "
                     f"{k.call_s * 1e3:.2f} ms per call{growth}")
    for name, link in profile.links.items():
        lines.append(f"  link {name}: {link.bandwidth_Bps / 1e6:.0f} MB/s, {link.latency_s * 1e6:.0f} us, "
                     f"all-gather {link.allgather} at {link.allgather_efficiency:.2f}, "
                     f"{link.compute_s_per_byte * 1e9:.2f} ns of compute per byte moved")
    if profile.fit:
        lines.append("  worst fit residual: " + ", ".join(f"{k} {v:.1%}" for k, v in profile.fit.items()))
    return "\n".join(lines)

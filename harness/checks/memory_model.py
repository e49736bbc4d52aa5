"""An analytic model of the extra host memory a distributed-optimizer checkpoint save costs a rank.

N = parameters of the rank's TP x PP shard, D = DP x CP size. The distributed optimizer keeps fp32
master params + exp_avg + exp_avg_sq: S = 12 N bytes per shard, split over the D ranks; the fp32
model weights P = 4 N are replicated over DP and written by one replica. Per format (see
docs/architecture.md):

- dp_reshardable / fully_sharded_model_space: no exchange; a rank stages at most what it writes,
  S/D (+ P on the replica that writes the weights). With megatron's fully parallel save wrapper
  the replicated weights are written by all D ranks in turn: (S + P)/D on every rank.
- fully_reshardable: the whole shard's state S is all-gathered into CPU memory on every DP rank,
  and the torch_dist writer stages / clones it again: between 1x and 3x S.
- fully_reshardable + mem_efficient: the gather goes to DP rank 0 only (1x-3x S there); the other
  ranks stay at S/D.

Measured on 4 gloo ranks (megatron-core 0.16.1, heap peak of the rank plus its writers; a fit of
peak = a x S + b per layout, format and rank over `tiny` and `small`): dp_reshardable a = 1/(3D)
(+ 1/3, i.e. P, on DP rank 0), fully_reshardable a = 2 + 1/D, mem_efficient off DP rank 0 a = 1/D;
every point sits inside its band with room. Bands are upper / lower bounds, not fits: they tell a
gathering save from a non-gathering one where 12N is large against the fixed cost (`discrimination`),
while the stored baselines catch smaller drifts.

On a GPU rank (`device=True`) the state lives on the device, and a save copies what the rank writes to
the host before writing it: megatron's writer preloads every tensor with `.to("cpu", non_blocking=True)`,
i.e. into pinned blocks of torch's caching host allocator, which rounds each block up to a power of two.
So the band's top grows by up to 2x the bytes the rank writes from the device (S/D, + P on the replica
writing the weights; (S + P)/D with the fully parallel wrapper). The measured figure holds that staging
(probes/memory.py: MemoryPeak.pinned_peak). From the first H100 run (`small`, D = 1, S + P = 92 MiB):
a `fully_reshardable` save's first-in-process peak 303.7 MiB against 207.2 later = ~96 MiB of new pinned
blocks for 92 MiB written. Measured with the pinned figure on one H200 (`small`, D = 1, torch 2.11, the same
in case order and shuffled): a dp_reshardable save staged 92.0 MiB (all it writes), fully_reshardable 23.0
(the weights; its optimizer state is gathered on the host heap, 207 MiB), fsdp2_sharded 69.0 (S), fsdp2_full
0 (gathered to the heap, 69.3 MiB) - each inside its band.

FSDP2 at D = 1 gathers nothing: the full and the sharded state dict are the same tensors, so both bands
are "at most what the rank writes" and the two cannot be told apart (`discrimination` says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.checks.expected_collectives import chunk_params
from harness.ckpt_formats import CkptFormat
from harness.layouts import coords_of, expert_coords
from harness.spec import Layout, ModelSpec

MIB = 1024 * 1024
# What a save costs a rank beyond its state (metadata, pickled common state, writer start-up). Measured:
# the intercept b of peak = a x S + b, fitted per (layout, format, rank) through `tiny` (S = 0.5-0.9 MiB,
# so its peaks are almost all fixed cost) and `small` (S = 35-69 MiB), 36 points of the default matrix at
# 4 gloo ranks (memray tracing Python allocators, harness/probes/memory.py): b from -0.10 to 1.14 MiB,
# largest on global rank 0 (the save's coordinator: 0.71-1.14 MiB in every format), <= 0.70 MiB on the
# other ranks; two runs of `tiny` agree within 0.14 MiB per point. 2 MiB leaves room for more tensors.
FIXED_COST = 2 * MIB
# What a load costs a rank beside the state (the checkpoint's metadata, the sharded state dict's objects, the
# loader's plan). Measured on 4 gloo ranks, where the state is under 1 MiB so that the peak is almost all this
# cost: `tiny`'s loads peaked at 1.0-2.5 MiB, `tiny-moe`'s (two optimizers, one per expert grid) at 1.8-3.5 MiB.
LOAD_FIXED_COST = 3 * MIB
STATE_BYTES_PER_PARAM = 12  # fp32 param + exp_avg + exp_avg_sq
WEIGHT_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class Band:
    low: int
    high: int
    why: str

    def contains(self, value: int) -> bool:
        return self.low <= value <= self.high

    def overlaps(self, other: Band) -> bool:
        return self.low <= other.high and other.low <= self.high

    def describe(self) -> str:
        return f"[{self.low / MIB:.1f}, {self.high / MIB:.1f}] MiB ({self.why})"


def shard_params(model: ModelSpec, layout: Layout, rank: int) -> int:
    """N: parameters held by the rank's TP x PP shard (all its virtual stages; an MoE model's local experts too)."""
    pp = coords_of(layout, rank).pp
    return sum(n for vp in range(layout.vpp) for _, n, _ in chunk_params(model, layout, pp, vp)) \
        + expert_shard_params(model, layout, rank)


def expert_shard_params(model: ModelSpec, layout: Layout, rank: int) -> int:
    """N_e: the rank's experts at EP > 1, which megatron keeps in buffers and an optimizer of their own, sharded
    over the expert-data-parallel group (0 for a dense model or at EP 1, where the experts are dense parameters)."""
    pp = coords_of(layout, rank).pp
    return sum(n for vp in range(layout.vpp) for _, n, _ in chunk_params(model, layout, pp, vp, expert_buffer=True))


def _dp_rank0(layout: Layout, rank: int) -> bool:
    c = coords_of(layout, rank)
    return c.dp == 0 and c.cp == 0


def _edp_rank0(layout: Layout, rank: int) -> bool:
    """Whether the rank is rank 0 of its expert-data-parallel group (it writes its experts' weights)."""
    return expert_coords(layout, rank)[2] == 0


def _fsdp2_band(fmt: str, n: int, d: int, rank: int, device: bool) -> Band:
    """FSDP2 (torch Adam, fp32): a rank holds S/D of S = 12 N (params + exp_avg + exp_avg_sq).
    Sharded (DCP): each rank stages at most its own S/D (copied off the device on a GPU). Full: rank 0
    gathers all of S on the CPU and serialises it (1x-3x S); the others only pass single tensors through
    the gathers. At D = 1 nothing is gathered: full and sharded are the same save."""
    s = STATE_BYTES_PER_PARAM * n
    staging = 2 * (s // d) if device else 0
    on = " + device staging <= 2 S/D" if device else ""
    if fmt == CkptFormat.FSDP2_FULL and rank == 0 and d > 1:
        return Band(int(0.8 * s), 3 * s + FIXED_COST, f"fsdp2_full rank 0: 1-3x S, S=12N, N={n / 1e6:.2f}M")
    if fmt == CkptFormat.FSDP2_FULL and d > 1:
        return Band(0, 2 * s // d + FIXED_COST, f"fsdp2_full: ~S/D passes through, S=12N, D={d}")
    if fmt == CkptFormat.FSDP2_FULL:  # D = 1: the whole state is the rank's own; a GPU copies it to the CPU (1-3x S)
        return Band(0, (3 * s if device else s) + FIXED_COST,
                    f"fsdp2_full at D=1: nothing to gather, <= {'3x ' if device else ''}S, N={n / 1e6:.2f}M")
    return Band(0, s // d + staging + FIXED_COST, f"fsdp2_sharded: <= S/D{on}, S=12N, N={n / 1e6:.2f}M, D={d}")


def gathers(fmt: str, layout: Layout, rank: int, model: ModelSpec | None = None) -> bool:
    """Whether the format gathers optimizer state on this rank during a save (the shard's whole, or for an MoE
    model at EP > 1 the dense or the experts' part: mem_efficient gathers each on rank 0 of its own DP group;
    model None: a dense model)."""
    if fmt == CkptFormat.FSDP2_FULL:
        return rank == 0 and layout.dp * layout.cp > 1
    experts = model is not None and expert_shard_params(model, layout, rank) > 0
    return fmt == CkptFormat.FULLY_RESHARDABLE or (fmt == CkptFormat.FULLY_RESHARDABLE_MEM_EFFICIENT and (
        _dp_rank0(layout, rank) or (experts and _edp_rank0(layout, rank))))


def save_band(fmt: str, model: ModelSpec, layout: Layout, rank: int, fully_parallel: bool = False,
              device: bool = False) -> Band:
    """Expected extra host bytes of a save for this rank and format (fully_parallel: megatron's
    FullyParallelSaveStrategyWrapper spreads the writes, it does not remove fully_reshardable's gather;
    device: the state lives on a GPU and what the rank writes is staged in pinned host memory)."""
    n = shard_params(model, layout, rank)
    d = layout.dp * layout.cp
    if fmt.startswith("fsdp2"):
        return _fsdp2_band(fmt, n, d, rank, device)
    # an MoE model at EP > 1: its experts' state S_e = 12 N_e is sharded over the expert-DP group (E ranks) and their
    # weights written by that group's rank 0; the dense part as a dense model's
    ne = expert_shard_params(model, layout, rank)
    nd, e = n - ne, (layout.edp if ne else 1)
    dp_rank0, edp_rank0 = _dp_rank0(layout, rank), bool(ne) and _edp_rank0(layout, rank)
    sd, se, p = STATE_BYTES_PER_PARAM * nd, STATE_BYTES_PER_PARAM * ne, WEIGHT_BYTES_PER_PARAM * n
    pd, pe = WEIGHT_BYTES_PER_PARAM * nd, WEIGHT_BYTES_PER_PARAM * ne
    if fully_parallel:
        own = (sd + pd) // d + (se + pe) // e
    else:
        own = sd // d + se // e + (pd if dp_rank0 else 0) + (pe if edp_rank0 else 0)
    what = "(S + P)/D" if fully_parallel else f"S/D{' + P' if dp_rank0 else ''}"
    if ne:
        what = "(S_e + P_e)/E" if fully_parallel else f"{what} + S_e/E{' + P_e' if edp_rank0 else ''}"
    staging, on = (2 * own, f" + device staging <= 2 x {what}") if device else (0, "")
    moe = f", N_e={ne / 1e6:.2f}M, E={e}" if ne else ""
    if fmt in (CkptFormat.DP_RESHARDABLE, CkptFormat.FULLY_SHARDED_MODEL_SPACE):
        return Band(0, own + staging + FIXED_COST, f"{fmt}: <= {what}{on}, S=12N, N={n / 1e6:.2f}M, D={d}{moe}")
    if fmt not in (CkptFormat.FULLY_RESHARDABLE, CkptFormat.FULLY_RESHARDABLE_MEM_EFFICIENT):
        raise ValueError(f"no memory model for checkpoint format {fmt!r}")
    everywhere = fmt == CkptFormat.FULLY_RESHARDABLE
    dense_gathered, experts_gathered = everywhere or dp_rank0, bool(ne) and (everywhere or edp_rank0)
    gathered = (sd if dense_gathered else 0) + (se if experts_gathered else 0)
    if not gathered:  # off both rank 0s: at most its own shard of the state
        off = "S/D + S_e/E" if ne else "S/D"
        return Band(0, sd // d + se // e + staging + FIXED_COST,
                    f"{fmt} off DP rank 0: <= {off}{on}, N={n / 1e6:.2f}M, D={d}{moe}")
    rest = (0 if dense_gathered else sd // d) + (0 if experts_gathered else se // e)
    where = " on every DP rank" if everywhere else (" on DP rank 0" if not ne else
                                                      f" on {'DP' if dense_gathered else 'expert-DP'} rank 0")
    which = ("S=12N" if dense_gathered and (experts_gathered or not ne)
             else "S_d=12N_d" if dense_gathered else "S_e=12N_e")  # what this rank gathers: all, dense, experts'
    return Band(gathered, 3 * gathered + rest + p + staging + FIXED_COST,
                f"{fmt}: 1-3x {which.split('=')[0]} gathered{where}{on}, {which}={gathered / MIB:.1f} MiB{moe}")


# A load's host peak, measured on gloo ranks (`small`, megatron-core 0.16.1): dp_reshardable 55, 32 and 21 MiB at
# DP 1, 2 and 4 (0.80-1.22 x the rank's part S/D: the fresh Adam state and ~9 MiB read at a time), fully_reshardable
# 148, 125 and 114 MiB (~1.5 x S beside the fresh Adam state; 63 MiB at TP 2 and PP 2 over DP 2). The smallest
# measured, as fractions: what a copy of the rank's state held through the load must stand out of.
LOAD_MEASURED_MIN = {"dp_reshardable": 0.80, "fully_reshardable": 1.5}


def _load_state(fmt: str, model: ModelSpec, layout: Layout, rank: int) -> tuple[int, int, str]:
    """(the state the load reads, the rank's own part of it, how the band names the read): S/D (+ S_e/E) for
    dp_reshardable, the whole shard's S for fully_reshardable (an MoE model's: its experts' state included)."""
    n = shard_params(model, layout, rank)
    ne = expert_shard_params(model, layout, rank)
    nd, d, e = n - ne, layout.dp * layout.cp, (layout.edp if ne else 1)
    own = STATE_BYTES_PER_PARAM * (nd // d + ne // e)
    if fmt == CkptFormat.DP_RESHARDABLE:
        return own, own, "S/D + S_e/E" if ne else "S/D"
    if fmt in (CkptFormat.FULLY_RESHARDABLE, CkptFormat.FULLY_RESHARDABLE_MEM_EFFICIENT):
        return STATE_BYTES_PER_PARAM * n, own, "S"
    raise ValueError(f"no load model for checkpoint format {fmt!r}")


def load_band(fmt: str, model: ModelSpec, layout: Layout, rank: int) -> Band:
    """Expected extra host bytes of loading a checkpoint of `fmt` into a fresh engine at `layout` (CPU ranks: the
    state lives on the host). The engine creates the empty Adam state it loads into (2/3 of the rank's part of the
    state), then dp_reshardable reads the rank's own flat buffers, S/D: at most both; fully_reshardable reads the
    whole shard's state S on every DP rank and keeps its part: at least S, at most 2 S beside the fresh state."""
    read, own, what = _load_state(fmt, model, layout, rank)
    fresh = 2 * own // 3
    moe = f", N_e={expert_shard_params(model, layout, rank) / 1e6:.2f}M" if "S_e" in what else ""
    if fmt == CkptFormat.DP_RESHARDABLE:
        return Band(0, read + fresh + LOAD_FIXED_COST,
                    f"{fmt} load: <= {what} read + the fresh Adam state, {what}={read / MIB:.1f} MiB{moe}")
    return Band(read, 2 * read + fresh + LOAD_FIXED_COST,
                f"{fmt} load: 1-2x S read + the fresh Adam state, S={read / MIB:.1f} MiB{moe}")


# Read from megatron-core 0.16.1 and torch's DCP, not measured on a GPU: the distributed optimizer's 64-element
# alignment gaps, the caching allocator's rounding and the object collectives' buffers of a load
DEVICE_LOAD_FIXED_COST = 8 * MIB


def glu_params(model: ModelSpec, layout: Layout, rank: int) -> int:
    """The rank's fc1 parameters of a GLU model (its experts' and shared experts' too); 0 without GLU."""
    if not model.swiglu:
        return 0
    pp = coords_of(layout, rank).pp
    return sum(n for vp in range(layout.vpp) for buffer in (False, True)
               for name, n, _ in chunk_params(model, layout, pp, vp, expert_buffer=buffer)
               if name.endswith("linear_fc1.weight"))


def device_load_band(fmt: str, model: ModelSpec, layout: Layout, rank: int) -> Band:
    """Expected device bytes above a load's start on a GPU rank (fp32 state). The engine creates the empty Adam
    state it loads into on the device (2/3 of the rank's part); both formats read into host memory and copy into
    the device state in place (fully_reshardable builds the whole shard's tensors on the host); a GLU model's fc1
    weights are merged from their two halves on the device and held through the load. A second copy of the
    rank's state is its part more."""
    _, own, _ = _load_state(fmt, model, layout, rank)
    part = "S/D + S_e/E" if expert_shard_params(model, layout, rank) else "S/D"
    glu = WEIGHT_BYTES_PER_PARAM * glu_params(model, layout, rank)
    merge = f" + the fc1 merge {glu / MIB:.1f} MiB" if glu else ""
    return Band(0, 2 * own // 3 + glu + DEVICE_LOAD_FIXED_COST,
                f"{fmt} load on the device: <= the fresh Adam state (2/3 x {part}, {part}={own / MIB:.1f} MiB){merge}")


def device_load_blind_spot(fmt: str, model: ModelSpec, layout: Layout, rank: int) -> str:
    """'' where a second copy of the rank's state beside what a correct load holds (the fresh Adam state and a
    GLU model's fc1 merge) leaves the device band; otherwise why it would not."""
    _, own, _ = _load_state(fmt, model, layout, rank)
    held = 2 * own // 3 + WEIGHT_BYTES_PER_PARAM * glu_params(model, layout, rank)
    if held + own > device_load_band(fmt, model, layout, rank).high:
        return ""
    return (f"a second copy of rank {rank}'s state ({own / MIB:.1f} MiB) beside what a correct load holds would "
            f"stay in the device band: it cannot tell; judge on a larger model or at a smaller DP")


def load_blind_spot(fmt: str, model: ModelSpec, layout: Layout, rank: int) -> str:
    """'' where a copy of the rank's state held through the load (a load that materialises the optimizer state
    twice) on top of the smallest load measured would leave the band; otherwise why it would not."""
    read, own, what = _load_state(fmt, model, layout, rank)
    kind = fmt.removesuffix("_mem_efficient")
    fresh = 2 * own // 3 if kind == CkptFormat.FULLY_RESHARDABLE else 0
    least = LOAD_MEASURED_MIN[kind] * read + fresh
    if least + own > load_band(fmt, model, layout, rank).high:
        return ""
    return (f"a second copy of rank {rank}'s state ({own / MIB:.1f} MiB) on top of the smallest load measured "
            f"({least / MIB:.1f} MiB here) would stay in the band: it cannot tell; judge "
            f"{'at DP 1 or ' if kind == 'fully_reshardable' else 'at a smaller DP or '}on a larger model (small)")


def rival(fmt: str, layout: Layout, rank: int, model: ModelSpec | None = None) -> str | None:
    """The format this rank's save must not be mistaken for: a gathering save against a non-gathering
    one (megatron: fully_reshardable vs dp_reshardable; FSDP2 on rank 0: full vs sharded state dict).
    None where no format gathers on this rank (FSDP2 off rank 0)."""
    if fmt.startswith("fsdp2"):
        return None if rank != 0 else ("fsdp2_sharded" if fmt == CkptFormat.FSDP2_FULL else "fsdp2_full")
    return "dp_reshardable" if gathers(fmt, layout, rank, model) else "fully_reshardable"


def discrimination(fmt: str, model: ModelSpec, layout: Layout, rank: int, fully_parallel: bool = False,
                   device: bool = False) -> str:
    """'' when this rank's band for `fmt` does not overlap its rival's (a peak inside it rules the rival
    out); otherwise the one-line reason the measured peak cannot tell the two formats apart here."""
    other = rival(fmt, layout, rank, model)
    if other is None:
        return ""
    mine, theirs = (save_band(f, model, layout, rank, fully_parallel, device) for f in (fmt, other))
    if not mine.overlaps(theirs):
        return ""
    s = STATE_BYTES_PER_PARAM * shard_params(model, layout, rank)
    if layout.dp * layout.cp == 1 and fmt.startswith("fsdp2"):
        return (f"cannot discriminate {fmt} from {other} at rank {rank}: D = DP x CP = 1, the full and the sharded "
                f"state dict are the same tensors (nothing to gather): needs world size 2 or more")
    if layout.dp * layout.cp == 1:
        return (f"cannot discriminate {fmt} from {other} at rank {rank}: D = DP x CP = 1, nothing to gather "
                f"(both stage the whole 12N = {s / MIB:.1f} MiB): needs DP x CP >= 2")
    low, high = sorted((mine, theirs), key=lambda b: b.low)
    return (f"cannot discriminate {fmt} from {other} at rank {rank} for this model: 12N = {s / MIB:.2f} MiB, "
            f"the non-gathering bound {low.high / MIB:.2f} MiB (incl. fixed cost {FIXED_COST / MIB:.0f} MiB) "
            f"reaches the gathered minimum {high.low / MIB:.2f} MiB")


@dataclass(frozen=True)
class Projection:
    fmt: str
    per_rank_low: int
    per_rank_high: int
    worst_rank: int
    per_node_high: int


def project(fmt: str, model: ModelSpec, layout: Layout, ranks_per_node: int) -> Projection:
    """Predicted per-rank and per-node extra host memory of a save, from the same model."""
    bands = [save_band(fmt, model, layout, r) for r in range(layout.world_size)]
    worst = max(range(len(bands)), key=lambda r: bands[r].high)
    node_high = max(sum(b.high for b in bands[i:i + ranks_per_node])
                    for i in range(0, len(bands), ranks_per_node))
    return Projection(fmt, bands[worst].low, bands[worst].high, worst, node_high)

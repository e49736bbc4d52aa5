"""An analytic model of the extra host memory a distributed-optimizer checkpoint save costs a rank.

N = parameters of the rank's TP x PP shard, D = DP x CP size. The distributed optimizer keeps fp32
master params + exp_avg + exp_avg_sq: S = 12 N bytes per shard, split over the D ranks; the fp32
model weights P = 4 N are replicated over DP and written by one replica. Per format (see
../shared/design/MEGATRON_FACTS.md):

- dp_reshardable / fully_sharded_model_space: no exchange; a rank stages what it writes,
  ~S/D (+ P on the replica that writes the weights). With megatron's fully parallel save wrapper
  the replicated weights are written by all D ranks in turn: ~(S + P)/D on every rank.
- fully_reshardable: the whole shard's state S is all-gathered into CPU memory on every DP rank,
  and the torch_dist writer stages / clones it again: between 1x and 3x S.
- fully_reshardable + mem_efficient: the gather goes to DP rank 0 only (1x-3x S there); the other
  ranks stay near S/D.

Bands are wide on purpose: they separate the formats (a factor ~D between them), while the stored
baselines catch smaller drifts. SLACK covers fixed costs (metadata, pickles, writer start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.checks.grad_sync import chunk_params, coords_of
from harness.spec import Layout, ModelSpec

MIB = 1024 * 1024
SLACK = 24 * MIB
STATE_BYTES_PER_PARAM = 12  # fp32 param + exp_avg + exp_avg_sq
WEIGHT_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class Band:
    low: int
    high: int
    why: str

    def contains(self, value: int) -> bool:
        return self.low <= value <= self.high

    def describe(self) -> str:
        return f"[{self.low / MIB:.0f}, {self.high / MIB:.0f}] MiB ({self.why})"


def shard_params(model: ModelSpec, layout: Layout, rank: int) -> int:
    """N: parameters held by the rank's TP x PP shard (all its virtual stages)."""
    pp = coords_of(layout, rank).pp
    return sum(n for vp in range(layout.vpp) for _, n, _ in chunk_params(model, layout, pp, vp))


def _fsdp2_band(fmt: str, n: int, d: int, rank: int) -> Band:
    """FSDP2 (torch Adam, fp32): a rank holds S/D of S = 12 N (params + exp_avg + exp_avg_sq).
    Sharded (DCP): each rank stages its own S/D. Full: rank 0 gathers all of S on the CPU and
    serialises it (1x-3x S); the others only pass single tensors through the gathers."""
    s = STATE_BYTES_PER_PARAM * n
    if fmt == "fsdp2_full" and rank == 0:
        return Band(int(0.8 * s), 3 * s + SLACK, f"fsdp2_full rank 0: 1-3x S, S=12N, N={n / 1e6:.2f}M")
    if fmt == "fsdp2_full":
        return Band(0, 2 * s // d + SLACK, f"fsdp2_full: ~S/D passes through, S=12N, D={d}")
    return Band(0, int(1.5 * s / d) + SLACK, f"fsdp2_sharded: ~S/D, S=12N, N={n / 1e6:.2f}M, D={d}")


def save_band(fmt: str, model: ModelSpec, layout: Layout, rank: int, fully_parallel: bool = False) -> Band:
    """Expected extra host bytes of a save for this rank and format (fully_parallel: megatron's
    FullyParallelSaveStrategyWrapper spreads the writes, it does not remove fully_reshardable's gather)."""
    n = shard_params(model, layout, rank)
    d = layout.dp * layout.cp
    if fmt.startswith("fsdp2"):
        return _fsdp2_band(fmt, n, d, rank)
    c = coords_of(layout, rank)
    dp_rank0 = c.dp == 0 and c.cp == 0
    s, p = STATE_BYTES_PER_PARAM * n, WEIGHT_BYTES_PER_PARAM * n
    own = (s + p) // d if fully_parallel else s // d + (p if dp_rank0 else 0)
    if fmt in ("dp_reshardable", "fully_sharded_model_space"):
        what = "(S + P)/D" if fully_parallel else f"S/D{' + P' if dp_rank0 else ''}"
        return Band(0, int(1.5 * own) + SLACK, f"{fmt}: ~{what}, S=12N, N={n / 1e6:.2f}M, D={d}")
    if fmt == "fully_reshardable" or (fmt == "fully_reshardable_mem_efficient" and dp_rank0):
        where = " on DP rank 0" if fmt.endswith("mem_efficient") else " on every DP rank"
        return Band(s, 3 * s + p + SLACK, f"{fmt}: 1-3x S gathered{where}, S=12N={s / MIB:.0f} MiB")
    if fmt == "fully_reshardable_mem_efficient":
        return Band(0, int(1.5 * own) + SLACK, f"{fmt} off DP rank 0: ~S/D, N={n / 1e6:.2f}M, D={d}")
    raise ValueError(f"no memory model for checkpoint format {fmt!r}")


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

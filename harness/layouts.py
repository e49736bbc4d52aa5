"""Which TP x PP x CP x DP layouts a model admits on a world size, why a layout is refused, and where a rank
sits in one (megatron's default rank order)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import BadInput
from harness.spec import Layout, ModelSpec


def violations(layout: Layout, model: ModelSpec, world_size: int | None = None,
               global_batch_size: int | None = None, micro_batch_size: int | None = None) -> list[str]:
    """Every constraint the layout breaks for this model (empty: valid)."""
    out: list[str] = []
    tp, pp, cp, dp, vpp = layout.tp, layout.pp, layout.cp, layout.dp, layout.vpp
    if world_size is not None and layout.world_size != world_size:
        out.append(f"tp*pp*cp*dp = {layout.world_size} != world size {world_size}")
    checks = [
        (model.num_attention_heads % tp, f"num_attention_heads={model.num_attention_heads} not divisible by tp={tp}"),
        (model.num_query_groups % tp, f"num_query_groups={model.num_query_groups} not divisible by tp={tp}"),
        (model.padded_vocab_size(tp) % tp, f"vocab_size={model.vocab_size} not divisible by tp={tp}"),
        (model.ffn_hidden_size % tp, f"ffn_hidden_size={model.ffn_hidden_size} not divisible by tp={tp}"),
        (model.num_layers % (pp * vpp),
         f"num_layers={model.num_layers} not divisible by pp*vpp={pp * vpp}"),
        (cp > 1 and model.seq_length % (2 * cp),
         f"seq_length={model.seq_length} not divisible by 2*cp={2 * cp} (zigzag CP split)"),
        (vpp > 1 and pp == 1, f"vpp={vpp} needs pp > 1 (interleaved pipeline)"),
    ]
    out += [msg for bad, msg in checks if bad]
    out += expert_violations(layout, model)
    gbs = global_batch_size or model.global_batch_size
    mbs = micro_batch_size or model.micro_batch_size
    if gbs % (mbs * dp):
        out.append(f"global_batch_size={gbs} not divisible by micro_batch_size*dp={mbs * dp}")
    return out


def expert_violations(layout: Layout, model: ModelSpec) -> list[str]:
    """What the layout's expert grid breaks (TP x CP x DP = ETP x EP x EDP per stage, megatron's rule)."""
    ep, etp = layout.ep, layout.expert_tp
    if not model.moe:
        return [f"ep={ep}, etp={etp}: model {model.name} has no experts"] if layout.expert_parallel else []
    grid = layout.tp * layout.cp * layout.dp
    checks = [
        (model.num_experts % ep, f"num_experts={model.num_experts} not divisible by ep={ep}"),
        (model.expert_ffn % etp, f"moe_ffn_hidden_size={model.expert_ffn} not divisible by etp={etp}"),
        (grid % (etp * ep), f"tp*cp*dp = {grid} not divisible by etp*ep = {etp * ep} (the expert grid of a "
                            f"stage: tp*cp*dp = etp*ep*edp)"),
        # megatron's MoE layer refuses TP without sequence parallelism: the sequence is split over TP
        (layout.tp > 1 and (model.seq_length // layout.cp) % layout.tp,
         f"seq_length/cp = {model.seq_length // layout.cp} not divisible by tp={layout.tp} (MoE with TP runs "
         f"sequence parallel)"),
    ]
    return [msg for bad, msg in checks if bad]


def validate(layout: Layout, model: ModelSpec, world_size: int | None = None, **batch) -> Layout:
    """The layout itself, or BadInput naming every violated constraint."""
    bad = violations(layout, model, world_size, **batch)
    if bad:
        raise BadInput(f"layout {layout.id} is invalid for model {model.name}: " + "; ".join(bad))
    return layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelSpec, world_size: int, **batch) -> list[Layout]:
    """Every valid non-interleaved layout of world_size for the model, ordered by (tp, pp, cp); for an MoE model
    each with every valid EP and ETP (ETP = TP first)."""
    if world_size < 1:
        raise BadInput(f"world size must be >= 1, got {world_size}")
    found = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            for cp in _divisors(world_size // (tp * pp)):
                dense = Layout(tp, pp, cp, world_size // (tp * pp * cp))
                for layout in [dense, *expert_layouts(dense, model)]:
                    if not violations(layout, model, world_size, **batch):
                        found.append(layout)
    return found


def expert_layouts(dense: Layout, model: ModelSpec) -> list[Layout]:
    """The layout with every EP and ETP its expert grid admits, but EP 1 at ETP = TP (the layout itself)."""
    if not model.moe:
        return []
    grid = dense.tp * dense.cp * dense.dp
    out = []
    for ep in _divisors(grid):
        for etp in sorted(_divisors(grid // ep), key=lambda t: (t != dense.tp, t)):
            layout = Layout(dense.tp, dense.pp, dense.cp, dense.dp, dense.vpp, ep, etp)
            if layout != dense:
                out.append(layout)
    return out


def default_matrix(model: ModelSpec, world_size: int, **batch) -> list[Layout]:
    """A suite's layouts when none are given: every valid dense layout (for an MoE model each with EP 1 and
    ETP = TP), then, for an MoE model, the expert layouts of expert_matrix."""
    dense = [lay for lay in enumerate_layouts(model, world_size, **batch) if not lay.expert_parallel]
    return dense + expert_matrix(model, world_size, **batch)


def expert_matrix(model: ModelSpec, world_size: int, **batch) -> list[Layout]:
    """The expert layouts every suite runs by default for an MoE model, where the model and world size allow
    them: EP 2 and EP 4 (and EP over the whole world) at pure DP, EP 2 with TP 2 at ETP 2 and ETP 1, EP 2 with
    CP 2 and with PP 2. (EP 1 with ETP != TP is left out: megatron-core up to 0.16 reduces such experts'
    gradients over the dense DP group - `harness run --suite equivalence --model tiny-moe --world-size 2
    --layout tp2-pp1-cp1-dp1-ep1-etp1` shows the replicas drifting.)"""
    if not model.moe:
        return []
    half = world_size // 2
    wanted = [Layout(dp=world_size, ep=ep) for ep in sorted({2, 4, world_size}) if ep > 1]
    if world_size % 2 == 0:
        wanted += [Layout(tp=2, dp=half, ep=2), Layout(tp=2, dp=half, ep=2, etp=1), Layout(cp=2, dp=half, ep=2),
                   Layout(pp=2, dp=half, ep=2)]
    out: list[Layout] = []
    for lay in wanted:
        if lay.world_size == world_size and lay not in out and not violations(lay, model, world_size, **batch):
            out.append(lay)
    return out


def reference_layouts(model: ModelSpec, world_size: int, ep: int = 1) -> list[Layout]:
    """Pure DP, then TP 2 and PP 2 over half the DP where the model allows them (tp1-pp1-cp1-dp4,
    tp2-pp1-cp1-dp2, tp1-pp2-cp1-dp2 at world size 4; only pure DP at an odd world size). ep > 1: an MoE model's
    experts at that EP on each, pure DP too only where its expert grid admits it."""
    half = [Layout(tp=2, dp=world_size // 2, ep=ep), Layout(pp=2, dp=world_size // 2, ep=ep)] \
        if world_size % 2 == 0 else []
    pure = [lay for lay in [Layout(dp=world_size, ep=ep)] if ep == 1 or not violations(lay, model, world_size)]
    return pure + [lay for lay in half if not violations(lay, model, world_size)]


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int


def coords_of(layout: Layout, rank: int) -> Coords:
    """megatron's default rank order tp-cp-ep-dp-pp (tp fastest)."""
    tp, rest = rank % layout.tp, rank // layout.tp
    cp, rest = rest % layout.cp, rest // layout.cp
    dp, pp = rest % layout.dp, rest // layout.dp
    return Coords(tp, cp, dp, pp)


def rank_of(layout: Layout, c: Coords) -> int:
    return c.tp + layout.tp * (c.cp + layout.cp * (c.dp + layout.dp * c.pp))


def dp_cp_ranks(layout: Layout, rank: int) -> tuple[int, ...]:
    """The ranks that hold the same TP/PP shard: megatron reduces gradients over all of them."""
    c = coords_of(layout, rank)
    return tuple(sorted(rank_of(layout, Coords(c.tp, cp, dp, c.pp))
                        for cp in range(layout.cp) for dp in range(layout.dp)))


def expert_coords(layout: Layout, rank: int) -> tuple[int, int, int]:
    """(etp, ep, edp) rank of a rank on its stage's expert grid, megatron's expert rank order tp-ep-dp (tp
    fastest) within each pipeline stage."""
    local = rank % (layout.tp * layout.cp * layout.dp)
    etp, rest = local % layout.expert_tp, local // layout.expert_tp
    return etp, rest % layout.ep, rest // layout.ep


def expert_group(layout: Layout, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    """The ranks of rank's stage that differ from it only along the named expert-grid axes ("etp", "ep", "edp"),
    sorted."""
    stage = rank - rank % (layout.tp * layout.cp * layout.dp)
    mine = dict(zip(("etp", "ep", "edp"), expert_coords(layout, rank)))
    etps, eps, edps = (range(size) if axis in axes else [mine[axis]]
                       for axis, size in (("etp", layout.expert_tp), ("ep", layout.ep), ("edp", layout.edp)))
    return tuple(sorted(stage + t + layout.expert_tp * (e + layout.ep * d) for t in etps for e in eps for d in edps))


def expert_dp_ranks(layout: Layout, rank: int) -> tuple[int, ...]:
    """The ranks that hold the same experts (same stage, ETP and EP rank): megatron reduces expert gradients over
    them at EP > 1."""
    return expert_group(layout, rank, ("edp",))

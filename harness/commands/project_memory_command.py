"""`harness project-memory`: predicted host memory of a checkpoint save at scale (the analytic model)."""

from __future__ import annotations

import math

from harness.checks.memory_model import MIB, project, save_band
from harness.checks.training_memory import GIB, Training, nearest_fitting, worst_rank
from harness.dtypes import DTYPES
from harness.errors import BadInput
from harness.layouts import validate
from harness.models import load_model
from harness.spec import Layout, Recompute

MAX_SEQ_LENGTH = 1 << 22  # 4M tokens: beyond any context trained today; a larger one is a typo
KNOWN_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")


def add_parser(sub) -> None:
    p = sub.add_parser("project-memory", help="predicted memory at scale: a checkpoint save's host peak, or "
                                               "(--training) a training rank's device memory")
    p.add_argument("--model", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--format", default=None)
    p.add_argument("--ranks-per-node", type=int, default=8)
    t = p.add_argument_group("training memory (--training)")
    t.add_argument("--training", action="store_true", help="project a training rank's memory instead of a save's")
    t.add_argument("--device-gib", type=float, default=None, help="the device's memory, GiB (a verdict: fits or not)")
    t.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    t.add_argument("--micro-batch-size", type=int, default=None, help="default: the model's")
    t.add_argument("--seq-length", type=int, default=None, help="default: the model's")
    t.add_argument("--global-batch-size", type=int, default=None, help="default: the model's")
    t.add_argument("--distributed-optimizer", action="store_true")
    t.add_argument("--grad-reduce-in-fp32", action="store_true")
    t.add_argument("--recompute", default="", choices=list(Recompute))
    t.add_argument("--sequence-parallel", action="store_true")
    t.add_argument("--fused-attention", action="store_true",
                   help="a fused / flash attention kernel (Transformer Engine): no a x s x s probabilities kept")
    p.set_defaults(func=main)


def training(args) -> int:
    """Each component of the worst rank's training memory in GiB, and whether it fits --device-gib."""
    import dataclasses

    model = load_model(args.model)
    if args.seq_length is not None and not 1 <= args.seq_length <= MAX_SEQ_LENGTH:
        raise BadInput(f"--seq-length must be between 1 and {MAX_SEQ_LENGTH} tokens (a micro-batch's sequence), "
                       f"got {args.seq_length}")
    if args.seq_length:
        model = dataclasses.replace(model, seq_length=args.seq_length)
    mbs = model.micro_batch_size if args.micro_batch_size is None else args.micro_batch_size
    gbs = model.global_batch_size if args.global_batch_size is None else args.global_batch_size
    if mbs < 1 or gbs < 1:
        raise BadInput(f"--micro-batch-size and --global-batch-size must be >= 1, got {mbs} and {gbs}")
    layout = validate(Layout.parse(args.layout), model, global_batch_size=gbs, micro_batch_size=mbs)
    if args.device_gib is not None and not (math.isfinite(args.device_gib) and args.device_gib > 0):
        raise BadInput(f"--device-gib must be a finite number of GiB > 0 (e.g. 80), got {args.device_gib}")
    tr = Training(dtype=args.dtype, micro_batch_size=mbs, num_microbatches=gbs // (mbs * layout.dp),
                  use_distributed_optimizer=args.distributed_optimizer, grad_reduce_in_fp32=args.grad_reduce_in_fp32,
                  recompute=args.recompute, fused_attention=args.fused_attention,
                  te_spec=args.fused_attention,
                  sequence_parallel=args.sequence_parallel)
    m = worst_rank(model, layout, tr)
    print(f"model {model.name} ({model.num_params() / 1e9:.2f}B params), layout {layout.id}, {args.dtype}, seq "
          f"{model.seq_length}, micro-batch {mbs}, {tr.num_microbatches} micro-batches per step, distributed "
          f"optimizer {'on' if tr.use_distributed_optimizer else 'off'}, recompute {tr.recompute or 'off'}, "
          f"attention {'fused' if tr.fused_attention else 'unfused (local spec)'}"
          + (", sequence parallel" if tr.sequence_parallel else ""))
    print(f"worst rank {m.rank} (GiB):")
    for name, value in m.rows():
        print(f"  {name:<16} {value / GIB:9.2f}")
    print(f"  {'peak':<16} {m.peak / GIB:9.2f}")
    if args.device_gib is None:
        return 0
    available = int(args.device_gib * GIB)
    if m.peak <= available:
        print(f"verdict: fits in {args.device_gib:g} GiB ({(available - m.peak) / GIB:.2f} GiB to spare)")
        return 0
    fix = nearest_fitting(model, layout, tr, available, layout.world_size)
    print(f"verdict: does NOT fit in {args.device_gib:g} GiB: {(m.peak - available) / GIB:.2f} GiB short"
          + (f"; nearest setting that fits: {fix}" if fix else "; no nearby setting fits"))
    return 1


def main(args) -> int:
    if args.training:
        return training(args)

    model = load_model(args.model)
    layout = validate(Layout.parse(args.layout), model)
    if args.format and args.format not in KNOWN_FORMATS:
        raise BadInput(f"--format {args.format!r}: no memory model for it; known: {', '.join(KNOWN_FORMATS)}")
    if args.ranks_per_node < 1:
        raise BadInput(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    formats = [args.format] if args.format else list(KNOWN_FORMATS)
    projections = [project(fmt, model, layout, args.ranks_per_node) for fmt in formats]
    print(f"model {model.name} ({model.num_params() / 1e9:.2f}B params), layout {layout.id}, "
          f"{args.ranks_per_node} ranks per node")
    gib = 1024 * MIB
    for fmt, p in zip(formats, projections):
        band = save_band(fmt, model, layout, p.worst_rank)
        print(f"{fmt:<34} per rank (worst: rank {p.worst_rank}) "
              f"{p.per_rank_low / gib:8.1f} - {p.per_rank_high / gib:8.1f} GiB"
              f"   per node up to {p.per_node_high / gib:9.1f} GiB   [{band.why}]")
    print("model: bounds from 12N optimizer state and 4N weights plus a 2 MiB fixed cost measured on CPU ranks; "
          "the ckpt-memory suite checks measured peaks of tiny / small on 4 gloo ranks against these bands "
          "(check 'ckpt-memory.model'); at this scale the figures are an extrapolation, not a measurement")
    return 0

"""`harness project-memory`: predicted host memory of a checkpoint save at scale (the analytic model)."""

from __future__ import annotations

from harness.errors import BadInput

KNOWN_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")


def add_parser(sub) -> None:
    p = sub.add_parser("project-memory", help="predicted host memory of a checkpoint save at scale")
    p.add_argument("--model", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--format", default=None)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.checks.memory_model import MIB, project, save_band
    from harness.layouts import validate
    from harness.models import load_model
    from harness.spec import Layout

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
        print(f"{fmt:<34} per rank (worst: rank {p.worst_rank}) {p.per_rank_low / gib:8.1f} - {p.per_rank_high / gib:8.1f} GiB"
              f"   per node up to {p.per_node_high / gib:9.1f} GiB   [{band.why}]")
    print("model: bounds from 12N optimizer state and 4N weights plus a 2 MiB fixed cost measured on CPU ranks; "
          "the ckpt-memory suite checks measured peaks of tiny / small on 4 gloo ranks against these bands "
          "(check 'ckpt-memory.model'); at this scale the figures are an extrapolation, not a measurement")
    return 0

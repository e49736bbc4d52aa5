"""`harness layouts`: the valid TP/PP/CP/DP layouts of a world size for a model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.errors import BadInput
from harness.layouts import enumerate_layouts, validate, violations
from harness.models import load_model
from harness.spec import Layout

if TYPE_CHECKING:
    from harness.spec import Layout, ModelSpec


def add_parser(sub) -> None:
    p = sub.add_parser("layouts", help="list the valid TP/PP/CP/DP (and EP/ETP) layouts of a world size for a model")
    p.add_argument("--world-size", type=int, required=True, help="the world size whose layouts are listed")
    p.add_argument("--model", required=True, help="the model they lay out (its heads, layers, experts decide)")
    p.add_argument("--layout", action="append", help="check these layout ids instead of listing all")
    p.set_defaults(func=main)


def main(args) -> int:
    model = load_model(args.model)
    if args.world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {args.world_size}")
    if args.layout:
        valid = [validate(Layout.parse(lid), model, args.world_size) for lid in args.layout]
        for lay in valid:
            print(f"{lay.id}\t{_sizes(lay, model)}  valid")
        return 0
    layouts = enumerate_layouts(model, args.world_size)
    if not layouts:
        why = "; ".join(violations(Layout(dp=args.world_size), model, args.world_size))
        raise BadInput(f"no layout of world size {args.world_size} is valid for model {model.name} "
                       f"(pure DP tp1-pp1-cp1-dp{args.world_size}: {why}); pick a world size that divides its shape")
    for lay in layouts:
        print(f"{lay.id}\t{_sizes(lay, model)}")
    return 0


def _sizes(lay: Layout, model: ModelSpec) -> str:
    """The layout's sizes spelled out; for an MoE model its expert grid too."""
    sizes = f"tp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp}" + (f" vpp={lay.vpp}" if lay.vpp > 1 else "")
    return sizes + (f" | ep={lay.ep} etp={lay.expert_tp} edp={lay.edp}" if model.moe else "")

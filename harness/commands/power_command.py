"""`harness power`: the detection power of the step-time judgements, measured by planted slowdowns
(harness/power.py). A benchmark: minutes of CPU, not a test."""

from __future__ import annotations

from harness.backends import Backend
from harness.commands.common import say
from harness.errors import BadInput
from harness.layouts import validate
from harness.models import load_model
from harness.platform import resolve_backend
from harness.selection import SHARED_FLAGS
from harness.spec import Layout
from harness.tables import table


def add_parser(sub) -> None:
    p = sub.add_parser("power", help="plant step slowdowns of 0/3/5/10/25%% and print how often step-perf's time "
                                     "check (vs a baseline) and harness compare (interleaved) detect each")
    # smaller than a run's defaults (the suite's model, world size 4): power runs every planted size and mode
    # `--trials` times, each a run of its own
    p.add_argument("--model", default="tiny", help="model of every planted run (default tiny)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of every planted run (default 2)")
    p.add_argument("--layout", default=None, help="default: pure DP over the world size")
    p.add_argument("--trials", type=int, default=5, help="runs per planted size and mode (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved: rounds per side per comparison (default 3)")
    p.add_argument("--timed-steps", type=int, default=12, help="timed steps per run / round (default 12)")
    p.add_argument("--mode", action="append", choices=["baseline", "compare"], help="default: both")
    p.add_argument("--backend", **{**SHARED_FLAGS["--backend"], "help": (
        "the node's ranks (auto: one GPU per rank where there are GPUs enough, else gloo); on GPU ranks the planted "
        "wait runs on the device")})
    p.set_defaults(func=main)


def main(args) -> int:
    if args.trials < 1 or args.rounds < 2 or args.timed_steps < 3 or args.world_size < 1:
        raise BadInput("--trials >= 1, --rounds >= 2, --timed-steps >= 3 and --world-size >= 1 are needed, got "
                       f"{args.trials}, {args.rounds}, {args.timed_steps}, {args.world_size}")
    layout = Layout.parse(args.layout) if args.layout else Layout(dp=args.world_size)
    validate(layout, load_model(args.model), args.world_size)
    from harness.power import run_power

    backend = resolve_backend(args.backend, args.world_size)
    say(f"planting on {backend} ranks ({'device-side waits' if backend == Backend.NCCL else 'busy waits on the host'})")
    tallies = run_power(args.model, args.world_size, layout.id, args.trials, args.rounds, args.timed_steps,
                        tuple(args.mode or ("baseline", "compare")), say, backend)
    print(table(["judged", "planted in", "slowdown", "hits", "rate [95% Wilson]", "cannot tell"],
                [t.row() for t in tallies]))
    return 0

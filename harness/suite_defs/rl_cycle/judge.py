"""rl-cycle's checks: replay, log-probs, the expert bias, the trajectory against the twin, offload and reload; what
the rollout gets (refit, policy, adapter) is rollout_judge.py's."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.checks import CheckResult, cannot_tell, case_failed
from harness.launch.results import CaseResult
from harness.stack import components
from harness.suite_defs.rl_cycle.params import MINI_BATCHES, SUITE, RLCycleCaseParams, Weights
from harness.suite_defs.rl_cycle.payload import at_iteration as _it
from harness.suite_defs.rl_cycle.payload import data
from harness.suite_defs.rl_cycle.rollout_judge import adapter, policy, refit
from harness.upstream import FROZEN_EXPERT_BIAS

KIB = 1024
# What an offload leaves may move by this much from one iteration to the next without growing: the allgather
# dispatcher keeps the last micro-batch's permutation of the tokens routed to its experts (at most tokens x top-k x 8
# bytes per MoE layer: tiny-moe's 2 KiB), whose size follows the routing.
GROWTH_SLACK = 4 * KIB


def params(result: CaseResult) -> RLCycleCaseParams:
    p = result.case.params
    return p if isinstance(p, RLCycleCaseParams) else RLCycleCaseParams()


def judge(results: list[CaseResult]) -> list[CheckResult]:
    out: list[CheckResult] = []
    by_id = {r.case.id: r for r in results}
    for res in results:
        if not res.ok:
            out.append(case_failed(f"{SUITE}.run", res))
            continue
        p = params(res)
        if res.case.model.moe:
            out.append(replay(res))
        out.append(logprobs(res))
        out.append(refit(res))
        out.append(policy(res))
        if res.case.options.lora_dim:
            out.append(adapter(res))
        if res.case.model.moe_expert_bias:
            out += expert_bias(res)
        if p.offload:
            out += offload(res)
            twin_id = dataclasses.replace(res.case, params=p.twin()).id
            out.append(trajectory(res, by_id.get(twin_id)))
    return out


# -- replay ---------------------------------------------------------------------------------------------------
def replay(res: CaseResult) -> CheckResult:
    """The routing each step used is the recorded one, layer by layer; RouterReplay lists exactly the live routers
    (none where routing is not replayed)."""
    import torch

    name, cid = f"{SUITE}.replay", res.case.id
    on = res.case.options.routing_replay
    fresh = 0
    for rank, d in enumerate(data(res)):
        for when, (listed, live, in_list) in zip(("after the build", "after the cycle"), d.instances):
            routers = len(d.iterations[0].recorded.layers) if d.iterations else 0
            want = routers if on else 0
            if listed != want or live != want or in_list != want:
                return CheckResult(name, cid, False,
                                   f"rank {rank} {when}: RouterReplay lists {listed} routers, {in_list} of them this "
                                   f"rank's {live} live ones; the model has {routers} MoE layers here"
                                   + (" (a routing replay entry per layer, no other build's)" if on
                                      else " and routing is not replayed: none may be listed or consulted"))
        if not on:
            continue
        for i, it in enumerate(d.iterations):
            cut = len(it.recorded.indices[0]) // MINI_BATCHES if it.recorded.indices else 0
            for k, used in enumerate(it.used):
                fresh += used.fresh_differs
                for layer, (got_all, rec_all) in enumerate(zip(used.indices, it.recorded.indices)):
                    for m, got in enumerate(got_all):
                        want = rec_all[k * cut + m].sort(dim=-1).values
                        if got.shape != want.shape or not torch.equal(got, want):
                            bad = (int((got != want).any(dim=-1).sum()) if got.shape == want.shape
                                   else f"shape {tuple(got.shape)} vs {tuple(want.shape)}:")
                            return CheckResult(name, cid, False,
                                               f"{_it(i, k)}, micro-batch {m + 1}, {used.layers[layer]}, rank "
                                               f"{rank}: {bad} of {want.shape[0]} tokens routed to other experts "
                                               "than the log-prob pass recorded")
    if not on:
        return CheckResult(name, cid, True, "routing not replayed: RouterReplay lists no router on any rank")
    if not fresh:
        return cannot_tell(name, cid, "every step used the recorded routing, but fresh scores chose the recorded "
                                      "experts at every token: replay had nothing to change (more iterations or a "
                                      "higher --lr would move the routing)")
    return CheckResult(name, cid, True, f"every step of every rank used the routing the log-prob pass recorded, "
                                        f"layer by layer ({fresh} tokens that fresh scores would have routed "
                                        f"elsewhere); RouterReplay lists exactly the live routers", value=fresh)


# -- log-probs --------------------------------------------------------------------------------------------------
def logprobs(res: CaseResult) -> CheckResult:
    """The first step's forward computes the log-prob pass's log-probs, bit for bit."""
    import torch

    name, cid = f"{SUITE}.logprobs", res.case.id
    compared = 0
    for rank, d in enumerate(data(res)):
        for i, it in enumerate(d.iterations):
            passed = {tuple(int(s) for s in t.samples): t.logprobs for t in it.logprobs}
            for t in it.train_logprobs:
                key = tuple(int(s) for s in t.samples)
                want = passed.get(key)
                if want is None:
                    return CheckResult(name, cid, False, f"{_it(i, 0)}, rank {rank}: samples {list(key)} have no "
                                                         "log-probs from the log-prob pass")
                if not torch.equal(t.logprobs, want):
                    diff = (t.logprobs.double() - want.double()).abs()
                    return CheckResult(name, cid, False,
                                       f"{_it(i, 0)}, rank {rank}, samples {list(key)}: the training forward's "
                                       f"log-probs differ from the log-prob pass's at {int((diff > 0).sum())} of "
                                       f"{diff.numel()} tokens (max {float(diff.max()):.3g}); the same weights, "
                                       "batch and routing must give them bit for bit", value=float(diff.max()))
                compared += t.logprobs.numel()
    if not compared:
        return CheckResult(name, cid, False, "no rank reported the training forward's log-probs (the last "
                                             "pipeline stage captures them)")
    return CheckResult(name, cid, True, f"the first step's forward gave the log-prob pass's log-probs bit for bit "
                                        f"({compared} tokens)", value=0.0)


# -- expert bias -------------------------------------------------------------------------------------------------
def expert_bias(res: CaseResult) -> list[CheckResult]:
    """With the router training and routing not replayed the bias moves at every step; frozen or replayed, it is
    held; and whether megatron itself moves a frozen router's bias (the probe)."""

    name, cid = f"{SUITE}.expert-bias", res.case.id
    held = res.case.options.freeze_router or res.case.options.routing_replay
    checked = 0
    for rank, d in enumerate(data(res)):
        for i, it in enumerate(d.iterations):
            for k in range(len(it.biases) - 1):
                for layer, before in it.biases[k].items():
                    moved = float((it.biases[k + 1][layer] - before).abs().max())
                    checked += 1
                    if held and moved:
                        why = "the router is frozen" if res.case.options.freeze_router else "routing is replayed"
                        return [CheckResult(name, cid, False, f"{_it(i, k)}, {layer}, rank {rank}: the expert bias "
                                                              f"moved by {moved:.3g} while {why}", value=moved)]
                    if not held and not moved:
                        return [CheckResult(name, cid, False, f"{_it(i, k)}, {layer}, rank {rank}: the expert bias "
                                                              "did not move with the router training: aux-loss-free "
                                                              "balancing is off")]
    if not checked:
        return [CheckResult(name, cid, False, "no expert bias was reported: the model's routers have none")]
    out = [CheckResult(name, cid, True, f"the expert bias {'held' if held else 'moved'} at every step of every "
                                        f"layer and rank ({checked} figures)")]
    probe = data(res)[0].probe
    if res.case.options.freeze_router and len(probe) == 2:
        out.append(_upstream(res, probe))
    return out


def _upstream(res: CaseResult, probe: list[dict[str, Any]]) -> CheckResult:
    """megatron's own expert-bias update in a step with the router frozen and nothing held by the framework: held
    where megatron-core honours frozen_expert_bias (the mark set as its training loop sets it); a known upstream
    defect, inconclusive, where the release has no such mechanism (Megatron-LM#4785)."""

    name, cid = f"{SUITE}.upstream-bias", res.case.id
    moved = max(float((probe[1][k] - v).abs().max()) for k, v in probe[0].items())
    mcore = components().get("megatron-core", "?")
    marked = all(d.bias_marked_frozen for d in data(res))
    if not moved:
        how = "its frozen_expert_bias set, as megatron's training loop sets it" if marked else "nothing marked"
        return CheckResult(name, cid, True, f"megatron-core {mcore} held a frozen router's expert bias itself ({how})",
                           value=0.0)
    if FROZEN_EXPERT_BIAS.present():
        return cannot_tell(name, cid, f"{FROZEN_EXPERT_BIAS.said()}: megatron-core {mcore} moved a frozen router's "
                                      f"expert bias by {moved:.3g} in a step with nothing held; the framework must "
                                      "hold it (this engine's hold_expert_bias does)", value=moved)
    if not marked:
        return CheckResult(name, cid, False, f"megatron-core {mcore} skips a router whose frozen_expert_bias is set, "
                                             f"but the routers were not marked when frozen (the engine's after_build "
                                             f"sets it as megatron's training loop does): the bias moved by "
                                             f"{moved:.3g}", value=moved)
    return CheckResult(name, cid, False, f"megatron-core {mcore} moved a frozen router's expert bias by {moved:.3g} "
                                         "although its frozen_expert_bias was set (the mechanism of "
                                         f"{FROZEN_EXPERT_BIAS.issue} does not hold it)", value=moved)


# -- trajectory ---------------------------------------------------------------------------------------------------
def trajectory(res: CaseResult, twin: CaseResult | None) -> CheckResult:
    """N iterations with offload train exactly as N without (a loaded case: as the case built with the loaded
    weights): each step's loss, gradient norm and zero count, and the parameters after the cycle, bit for bit."""
    import torch

    p = params(res)
    loaded = p.weights == Weights.LOADED
    name, cid = (f"{SUITE}.load" if loaded else f"{SUITE}.trajectory"), res.case.id
    what = "the case built with the loaded weights" if loaded else "the same iterations without offload"
    if twin is None or not twin.ok:
        return CheckResult(name, cid, False, f"{what} ({dataclasses.replace(res.case, params=p.twin()).id}) "
                                             f"{'did not run' if twin is None else 'failed'}: nothing to compare with")
    for rank, (got, want) in enumerate(zip(data(res), data(twin))):
        for s, (a, b) in enumerate(zip(got.steps, want.steps)):
            for figure in ("loss_sum", "grad_norm", "num_zeros"):
                x, y = getattr(a, figure), getattr(b, figure)
                if x != y:
                    i, k = divmod(s, MINI_BATCHES)
                    return CheckResult(name, cid, False,
                                       f"{_it(i, k)}, rank {rank}: {figure.replace('_', ' ')} {x!r} vs {y!r} of "
                                       f"{what}" + (" (the optimizer's master copies did not follow the loaded "
                                                    "weights: its first update was applied to other values)"
                                                    if p.weights == "loaded" else ""))
        if len(got.steps) != len(want.steps):
            return CheckResult(name, cid, False, f"rank {rank}: {len(got.steps)} steps ran, {what} ran "
                                                 f"{len(want.steps)} (a cycle stops at a reload that failed: "
                                                 "rl-cycle.reload says where)")
        theirs = {sh.name: sh.tensor for sh in want.params}
        for sh in got.params:
            other = theirs.get(sh.name)
            if other is None or not torch.equal(sh.tensor, other):
                diff = "missing" if other is None else f"max difference {float((sh.tensor - other).abs().max()):.3g}"
                return CheckResult(name, cid, False, f"after {len(got.iterations)} iterations, rank {rank}: "
                                                     f"{sh.name} differs from {what}'s ({diff})")
    return CheckResult(name, cid, True, f"{len(data(res)[0].steps)} steps' losses, gradient norms and the parameters "
                                        f"equal {what}'s bit for bit")


# -- offload -------------------------------------------------------------------------------------------------------
def offload(res: CaseResult) -> list[CheckResult]:
    """Every offload moved the parameters, gradients and optimizer state and left no more than the residue bound;
    the residue does not grow from one iteration to the next; every reload brought everything back."""
    cid = res.case.id
    worst = 0
    for rank, d in enumerate(data(res)):
        for i, it in enumerate(d.iterations):
            o = it.offload
            if o is None:
                continue
            if o.not_back:
                return [CheckResult(f"{SUITE}.reload", cid, False,
                                    f"{_it(i)}, rank {rank}: the reload did not bring back {len(o.not_back)} "
                                    f"tensors: {', '.join(o.not_back[:3])}")]
            if o.left:
                return [CheckResult(f"{SUITE}.offload", cid, False,
                                    f"{_it(i)}, rank {rank}: the offload left {len(o.left)} tensors on the device: "
                                    f"{', '.join(o.left[:3])}")]
            worst = max(worst, o.bytes)
            if o.bytes > d.residue_bound:
                return [CheckResult(f"{SUITE}.offload", cid, False,
                                    f"{_it(i)}, rank {rank}: {o.bytes / KIB:.1f} KiB in {o.storages} tensors stayed on "
                                    f"the device after the offload, over the residue bound {d.residue_bound / KIB:.1f} "
                                    f"KiB (the model's buffers, the dispatchers' last micro-batch, 64 KiB); largest: "
                                    f"{_largest(o.largest)}", value=o.bytes / KIB)]
        done = [it.offload for it in d.iterations if it.offload is not None]
        later = done[1:]  # the first iteration pays what the process allocates once
        if len(later) >= 2 and (all(b.storages > a.storages for a, b in zip(later, later[1:]))
                                or all(b.bytes - a.bytes > GROWTH_SLACK for a, b in zip(later, later[1:]))):
            last = len(done) - 1
            grew = done[last].bytes - done[1].bytes
            return [CheckResult(f"{SUITE}.offload", cid, False,
                                f"{_it(last)}, rank {rank}: the device held {grew / KIB:+.1f} KiB and "
                                f"{done[last].storages - done[1].storages:+d} tensors more after the offload than "
                                f"after iteration 2's, more at every iteration: something of each stays (new in "
                                f"{_it(last)}: {', '.join(done[last].new[:3]) or 'none named'})", value=grew / KIB)]
    bound = data(res)[0].residue_bound
    return [CheckResult(f"{SUITE}.offload", cid, True, f"every offload left at most {worst / KIB:.1f} KiB on the "
                        f"device (bound {bound / KIB:.1f} KiB), the same from iteration 2 on", value=worst / KIB),
            CheckResult(f"{SUITE}.reload", cid, True, "every reload brought the parameters, gradients and optimizer "
                                                      "state back")]


def _largest(largest: list[tuple[str, int]]) -> str:
    return ", ".join(f"{what} {n / KIB:.1f} KiB" for what, n in largest[:3]) or "none"


def residue_data(result: CaseResult) -> dict[str, Any]:
    """For the report's plot: per rank, the bytes left on the device after each iteration's offload (None where it did
    not offload), and the bound they are judged by."""
    ranks = data(result)
    if not ranks or not any(it.offload for d in ranks for it in d.iterations):
        return {}
    return {"residue_bytes": {str(r): [None if it.offload is None else it.offload.bytes for it in d.iterations]
                              for r, d in enumerate(ranks)},
            "residue_bound_bytes": ranks[0].residue_bound}


def table_figures(result: CaseResult) -> dict[str, Any]:
    ranks = data(result)
    residues = [it.offload.bytes for d in ranks for it in d.iterations if it.offload is not None]
    allocated = [it.offload.allocated for d in ranks for it in d.iterations if it.offload is not None]
    return {"iterations": len(ranks[0].iterations) if ranks else 0,
            **({"residue KiB": round(max(residues) / KIB, 1)} if residues else {}),
            **({"allocated MiB": round(max(allocated) / KIB / KIB, 1)} if any(allocated) else {})}

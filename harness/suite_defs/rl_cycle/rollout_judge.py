"""rl-cycle's checks of what the rollout gets each iteration: the export (`refit`), the policy the Hugging Face model
loaded from it serves (`policy`) and, with LoRA, the adapter-only refit (`adapter`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from harness.checks import CheckResult, cannot_tell
from harness.checks.numeric import fmt_err
from harness.checks.step_outputs import LogprobDiff, hf_logprob_rtol, reports_batch
from harness.checks.tensors import assemble
from harness.checks.weight_stream import Expected, check_complete, check_values, reference
from harness.dtypes import dtype
from harness.engines.lora import expected_hf_adapter, merged_weights
from harness.launch.results import CaseResult
from harness.suite_defs.rl_cycle.params import EXPORT_KEPT, SUITE
from harness.suite_defs.rl_cycle.payload import RLCycleRankData, data
from harness.suite_defs.rl_cycle.payload import at_iteration as _it


# -- refit ------------------------------------------------------------------------------------------------------------
def refit(res: CaseResult) -> CheckResult:
    """Each iteration's export, after its training and the optimizer's offload: every key once, and equal bit for bit to
    the parameters that iteration trained (mapped to Hugging Face names by the harness's own arithmetic); every rank's
    copy rank 0's. A stream that repeats an earlier iteration's bytes is named as such."""

    name, cid, c = f"{SUITE}.refit", res.case.id, res.case
    where = f"{c.model.name} at {c.layout.id}"
    ranks = data(res)
    exports = [[it.refit for it in d.iterations] for d in ranks]
    if ranks[0].export_refused:
        return cannot_tell(name, cid, f"{where}: engine {c.engine}'s export cannot run here, so no iteration's "
                                      f"refit is judged: {ranks[0].export_refused}")
    if any(e is None for per_rank in exports for e in per_rank):
        return cannot_tell(name, cid, f"{where}: engine {c.engine} exports nothing (no export_buckets: harness.engines."
                                      "base.ExportsWeights), so no iteration's refit is judged")
    seen: list[tuple[tuple[str, str], ...]] = []  # rank 0's stream per iteration: (name, digest) in order
    n, tensors = len(exports[0]), 0
    for i in range(n):
        its = [per_rank[i] for per_rank in exports]
        assert all(e is not None for e in its)  # for the type checker: refused above
        full = assemble([e.params for e in its if e]).tensors
        if c.options.lora_dim:  # the merged form: what the rollout's model must hold is W + (alpha / r) B A
            full = merged_weights(full, c.options.lora_alpha, c.options.lora_dim, dtype(c.options.dtype).torch)
        ref = reference(full, c.model)
        tied = {"lm_head.weight"} - set(ref) if c.model.tie_embeddings else set()
        want = Expected({k: tuple(t.shape) for k, t in ref.items()}, tied, "the harness's mapping")
        at = f"{_it(i)} of {n}: {where}"
        gone = next(((r.rank, e.read_offloaded) for r, e in zip(res.ranks, its) if e and e.read_offloaded), None)
        if gone is not None:
            more = f" and {len(gone[1]) - 1} more" if len(gone[1]) > 1 else ""
            return CheckResult(name, cid, False, f"{at}: rank {gone[0]}: {gone[1][0]}{more} had left the device when "
                                                 "the export was due (after the optimizer's offload): the export would "
                                                 "read freed storage, so none ran; the optimizer's offload must leave "
                                                 "the model's own parameters for the export")
        per_rank = [(r.rank, e.sent) for r, e in zip(res.ranks, its) if e]
        stream = tuple((s.name, s.digest) for s in per_rank[0][1])
        for verdict in (check_complete(name, cid, at, per_rank, want),
                        check_values(name, cid, at, per_rank, want, ref, (its[0].stream if its[0] else None) or {})):
            if verdict.failed:
                if stream in seen:
                    return dataclasses.replace(verdict, message=f"{verdict.message}; its stream is "
                                               f"{_it(seen.index(stream))}'s, byte for byte: an export cached and "
                                               "sent again")
                return verdict
        for r, e in zip(res.ranks, its):
            repeats = e.repeats if e else []
            for k, again in enumerate(repeats):
                moved = _first_difference(e.sent, again) if e else ""
                if moved:
                    return CheckResult(name, cid, False, f"{at}: rank {r.rank}: refit {k + 2} of {len(repeats) + 1} "
                                                         f"in a row, with no training between, differs from the first "
                                                         f"at {moved}: the merge is applied again at every refit (the "
                                                         "adapters merged into the base weights in place?)")
        for r, e in zip(res.ranks, its):
            if e is None or e.after_reload is None:
                continue
            at_key = _first_difference(e.sent, e.after_reload)
            if at_key:
                return CheckResult(name, cid, False, f"{at}: rank {r.rank}: the export after the reload differs from "
                                                     f"the one before the offload at {at_key}: the reload did not "
                                                     "bring back the weights that were offloaded")
        seen.append(stream)
        tensors += sum(len(sent) for _, sent in per_rank)
    reloaded = " and the same after the reload" if any(e and e.after_reload is not None for x in exports for e in x) \
        else ""
    leak, kept = _kept(name, cid, where, res, exports)
    if leak is not None:
        return leak
    return CheckResult(name, cid, True, f"{where}: each of {n} iterations' exports ({tensors} tensors sent by "
                                        f"{len(ranks)} ranks) holds every key once and equals the parameters that "
                                        f"iteration trained, bit for bit{reloaded}; {kept}")


def _kept(name: str, cid: str, where: str, res: CaseResult, exports: list[list[Any]]) -> tuple[CheckResult | None, str]:
    """What the exports kept once they ended, from the second iteration on: a failure where a rank's export kept more
    than EXPORT_KEPT at every one of them (memory that grows with every refit), else what the pass says of it."""
    measured = [(r.rank, [e.kept if e else None for e in x[1:]]) for r, x in zip(res.ranks, exports)]
    if any(k is None for _, ks in measured for k in ks):
        return None, "what an export keeps is not judged (the rank cannot read its live heap: glibc >= 2.33 can)"
    per_rank = [(rank, [int(k or 0) for k in ks]) for rank, ks in measured]
    if not per_rank or len(per_rank[0][1]) < 3:
        return None, "what an export keeps is not judged (fewer than 3 iterations after the first ran)"
    rank, ks = max(per_rank, key=lambda rk: min(rk[1]))
    stream = _stream_bytes(exports[0][0].sent if exports and exports[0] and exports[0][0] else [])
    if min(ks) > EXPORT_KEPT:
        each = ", ".join(f"{k / 1024:.0f}" for k in ks)
        return CheckResult(name, cid, False, f"iterations 2-{len(ks) + 1} of {len(ks) + 1}: {where}: rank {rank}: "
                                             f"every export from the second on kept memory once it ended ({each} KiB, "
                                             f"above {EXPORT_KEPT >> 10} KiB each): what the export holds grows with "
                                             "every refit (buffers kept past the send: serialized buckets, IPC "
                                             "handles, host copies)"), ""
    least = (f"the least a rank's export kept at every iteration from the second on was {min(ks) / 1024:.0f} KiB "
             f"(rank {rank})")
    if stream <= EXPORT_KEPT:
        return None, (f"{least}; a sender that keeps what it sends is not told apart here: the stream ({stream >> 10} "
                      f"KiB) is below what a leak must keep at each iteration ({EXPORT_KEPT >> 10} KiB)")
    return None, f"{least} (a leak keeps above {EXPORT_KEPT >> 10} KiB at each)"


def _stream_bytes(sent: list[Any]) -> int:
    """The bytes of one export's tensors as a rank received them."""
    import torch

    return sum(math.prod(s.shape) * torch.empty((), dtype=getattr(torch, s.dtype)).element_size() for s in sent)


def _first_difference(before: list[Any], after: list[Any]) -> str:
    """Where two exports (lists of Sent) first differ: 'name (bucket b)', or the count of tensors; '' where equal."""
    pairs = list(zip(before, after))
    moved = next((f"{b.name} (bucket {b.bucket})" for b, a in pairs if (b.name, b.digest) != (a.name, a.digest)), "")
    return moved or ("" if len(before) == len(after) else f"{len(after)} tensors, not {len(before)}")


def policy(res: CaseResult) -> CheckResult:
    """The rollout's policy is the one the trainer scores: at every iteration but the last, the Hugging Face model
    loaded from the iteration's export computes the next iteration's log-prob pass (Megatron's, every token of the
    first mini-batch's samples)."""
    name, cid, c = f"{SUITE}.policy", res.case.id, res.case
    where = f"{c.model.name} at {c.layout.id}"
    ranks = data(res)
    first = [it.refit for it in ranks[0].iterations]
    if ranks[0].export_refused:
        return cannot_tell(name, cid, f"{where}: engine {c.engine}'s export cannot run here: {ranks[0].export_refused}")
    if not first or any(e is None for e in first):
        return cannot_tell(name, cid, f"{where}: engine {c.engine} exports nothing, so no rollout policy is judged")
    if len(first) < 2:
        return cannot_tell(name, cid, f"{where}: the cycle stopped after {_it(0)}: no next log-prob pass to compare "
                                      "the rollout's policy with")
    broken = next(((i, e.policy_error) for i, e in enumerate(first) if e is not None and e.policy_error), None)
    if broken:
        return CheckResult(name, cid, False, f"{_it(broken[0])} of {len(first)}: {where}: {broken[1]}: the rollout "
                                             "could not load the export")
    skipped = next((i for i, e in enumerate(first[:-1]) if e is not None and not e.sent), None)
    if skipped is not None:
        return cannot_tell(name, cid, f"{where}: {_it(skipped)}'s export did not run (parameters off the device: "
                                      "`refit` names them), so the rollout had no policy to judge")
    if any(e and e.policy is None for e in first[:-1]):
        return cannot_tell(name, cid, f"{where}: no Hugging Face policy from the export: "
                                      f"{next(e.policy_none for e in first if e is not None and e.policy is None)}")
    t = c.params.temperature
    return _against_next_passes(name, cid, where + (f", temperature {t:g}" if t != 1.0 else ""), ranks,
                                [e.policy if e else None for e in first], c.options.dtype,
                                "the Hugging Face model loaded from {it}'s export",
                                [e.policy_entropy if e else None for e in first])


def adapter(res: CaseResult) -> CheckResult:
    """(LoRA) The adapter-only refit serves the policy the trainer scores: at every iteration but the last, its
    tensors equal the adapters that iteration trained bit for bit (and its config their r and alpha), and peft serving
    it over the base weights computes the next iteration's log-prob pass."""
    name, cid, c = f"{SUITE}.adapter", res.case.id, res.case
    where = f"{c.model.name} at {c.layout.id}"
    ranks = data(res)
    first = [it.refit for it in ranks[0].iterations]
    if len(first) < 2 or any(e is None or not e.sent for e in first[:-1]):
        return cannot_tell(name, cid, f"{where}: no adapter-only refit ran at every iteration (the export did not run: "
                                      "`refit` says why)")
    for i, e in enumerate(first[:-1]):
        wrong = _adapter_unlike_trained(res, i, e.adapter_tensors if e else None, e.adapter_config if e else None)
        if wrong:
            return CheckResult(name, cid, False, f"{_it(i)} of {len(first)}: {where}: the adapter-only refit {wrong}")
    broken = next(((i, e.adapter_error) for i, e in enumerate(first) if e is not None and e.adapter_error), None)
    if broken:
        return CheckResult(name, cid, False, f"{_it(broken[0])} of {len(first)}: {where}: {broken[1]}: the rollout "
                                             "could not load the adapter")
    why = next((e.adapter_none for e in first[:-1] if e is not None and e.adapter_policy is None), None)
    if why is not None:
        return cannot_tell(name, cid, f"{where}: no adapter-only policy: {why}")
    verdict = _against_next_passes(name, cid, where, ranks, [e.adapter_policy if e else None for e in first],
                                   c.options.dtype, "peft serving {it}'s adapter over the base weights")
    if not verdict.passed:
        return verdict
    return dataclasses.replace(verdict, message=f"{verdict.message}; each adapter sent equals the one trained, bit "
                                                "for bit")


def _adapter_unlike_trained(res: CaseResult, i: int, sent: dict[str, Any] | None, config: dict[str, Any] | None
                            ) -> str:
    """How iteration i's adapter-only refit (PEFT-named tensors, adapter_config.json) differs from the adapters that
    iteration trained, by the harness's own mapping, bit for bit; '' where it does not."""
    import torch

    c = res.case
    if sent is None or config is None:
        return "was not read back on rank 0"
    if (config.get("r"), config.get("lora_alpha")) != (c.options.lora_dim, c.options.lora_alpha):
        return (f"says r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; trained with "
                f"r={c.options.lora_dim}, alpha={c.options.lora_alpha}")
    params = [it.refit.params for d in data(res) for it in d.iterations[i:i + 1] if it.refit is not None]
    want = expected_hf_adapter(assemble(params).tensors, c.model)
    if set(sent) != set(want):
        missing, extra = sorted(set(want) - set(sent)), sorted(set(sent) - set(want))
        return f"holds other keys than the trained adapters: missing {missing[:2]}, unexpected {extra[:2]}"
    for key, t in sent.items():
        if t.shape != want[key].shape or not torch.equal(t.float(), want[key]):
            diff = float((t.float() - want[key]).abs().max()) if t.shape == want[key].shape else float("nan")
            return (f"sends {key} unlike the trained adapter (largest difference {diff:.3g}): the rollout's peft "
                    "serves other adapters")
    return ""


def _against_next_passes(name: str, cid: str, where: str, ranks: list[RLCycleRankData], served: list[Any],
                         dtype_name: Any, what: str, entropy: list[Any] | None = None) -> CheckResult:
    """Each iteration's served log-probs (rank 0's [G, seq] of the next iteration's batch) against the next
    iteration's log-prob pass (every token of its first mini-batch's samples), within the dtype's tolerance for a
    Hugging Face model; `what` names the server, {it} the iteration. entropy: the served entropies likewise, judged
    against the pass's where the engine's log-prob head computed them."""
    import torch

    rtol = hf_logprob_rtol(dtype_name)
    n, tokens, worst, entropies = len(served), 0, [], []
    for i in range(n - 1):
        hf = served[i]
        parts = [part for d in ranks if reports_batch(d.coords)
                 for part in d.iterations[i + 1].logprobs]
        if hf is None or not parts:
            return CheckResult(name, cid, False, f"{_it(i + 1)} of {n}: {where}: no log-prob pass log-probs captured")
        ref = torch.cat([part.logprobs.double() for part in parts])
        got = torch.cat([hf[part.samples.view(-1, 1), part.positions.view(1, -1)] for part in parts])
        diff = LogprobDiff.of(got, ref, rtol)
        if diff.bad.any():
            row = diff.first_sample
            sample = int(torch.cat([part.samples for part in parts])[row])
            return CheckResult(name, cid, False, f"{_it(i + 1)} of {n}: {where}: {what.format(it=_it(i))} differs "
                                                 f"from the log-prob pass at {int(diff.bad.sum())}/{ref.numel()} "
                                                 f"tokens (worst rel {fmt_err(diff.worst)} > {rtol:.0e}): the rollout "
                                                 "samples with another policy than the trainer scores; first: sample "
                                                 f"{sample}", value=diff.worst)
        tokens += ref.numel()
        worst.append(diff.worst)
        served_entropy = entropy[i] if entropy else None
        if served_entropy is None or any(part.entropy is None for part in parts):
            continue
        ref = torch.cat([part.entropy.double() for part in parts if part.entropy is not None])
        got = torch.cat([served_entropy[part.samples.view(-1, 1), part.positions.view(1, -1)] for part in parts])
        diff = LogprobDiff.of(got, ref, rtol)
        if diff.bad.any():  # a value not finite counts as beyond
            sample = int(torch.cat([part.samples for part in parts])[diff.first_sample])
            return CheckResult(name, cid, False, f"{_it(i + 1)} of {n}: {where}: the entropy of "
                                                 f"{what.format(it=_it(i))} differs from the log-prob pass's at "
                                                 f"{int(diff.bad.sum())}/{ref.numel()} positions (worst rel "
                                                 f"{fmt_err(diff.worst)} > {rtol:.0e}): the trainer's entropy is not "
                                                 f"the rollout policy's; first: sample {sample}", value=diff.worst)
        entropies.append(diff.worst)
    per = ", ".join(fmt_err(w) for w in worst)
    also = (f"; its entropy too, worst rel {fmt_err(max(entropies))}" if len(entropies) == len(worst) and entropies
            else "")
    return CheckResult(name, cid, True, f"{where}: at each of {n - 1} iterations {what.format(it='the iteration')} "
                                        f"computes the next log-prob pass ({tokens} tokens), worst rel per iteration "
                                        f"{per} <= {rtol:.0e}{also}", value=max(worst))

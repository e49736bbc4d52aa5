"""How a checkpoint load failed, in one line, and whether it was the refusal a format gives for a layout it does not
promise: shared by the suites that load checkpoints at other layouts (ckpt-memory's contract, peft-ckpt's reloads)."""

from __future__ import annotations


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside torch's CheckpointException (failures: rank -> (exc, traceback)),
    or the exception itself."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [exc]
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]


def _one_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [""])[0].strip("'\"")
    text = text.split(" from model not in state dict")[0] + (" from model not in state dict"
                                                            if "from model not in state dict" in text else "")
    return f"{type(exc).__name__}: {text[:300]}"


def describe_exception(exc: BaseException) -> str:
    """One line; for a CheckpointException, the first rank's own failure (its str() lists every rank)."""
    inner = _failures(exc)
    if inner == [exc]:
        return _one_line(exc)
    return f"{type(exc).__name__} on {len(inner)} rank(s), first: {_one_line(inner[0])}"


def refusal_kind(exc: BaseException) -> str:
    """What the load rejected when it refused the checkpoint for this layout, or '' when the exception
    is not that kind of refusal.

    Measured (megatron-core 0.16.1, torch_dist): a dp_reshardable checkpoint saved at tp1-pp1-dp4 and
    loaded at tp2-dp2 or pp2-dp2 raises torch's CheckpointException from the load, every rank's failure
    being megatron's shape validation of the flat optimizer buffers: KeyError '<optimizer.distributed...>
    from model not in state dict' (this DP group's buffer is not in the checkpoint) or
    CheckpointingException 'Global shape mismatch' (its bucket has another size). Only that is a refusal;
    anything else (an error in build, another exception) is a failure."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if _optimizer_count_differs(exc):
        return ("the checkpoint holds the state of another number of chained optimizers (an MoE model's dense and "
                f"expert optimizers at EP > 1, one at EP 1): {_one_line(exc)}")
    inner = _failures(exc)
    for e in inner:
        text = str(e)
        if not (isinstance(e, (KeyError, CheckpointingException)) and "optimizer.distributed." in text
                and ("from model not in state dict" in text or "Global shape mismatch" in text)):
            return ""
    return f"the checkpoint's flat optimizer buffers do not fit this layout ({_one_line(inner[0])})"


def _optimizer_count_differs(exc: BaseException) -> bool:
    """Whether megatron's optimizer refused the loaded state for holding another number of chained optimizers:
    a single optimizer given the per-sub-optimizer states of a ChainedOptimizer (KeyError 'optimizer' in its
    load_state_dict), or a ChainedOptimizer given another count ("Expected N entries in state dict")."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_name, tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    in_optimizer_load = any(name == "load_state_dict" and "megatron/core/optimizer/" in path.replace("\\", "/")
                            for name, path in frames)
    single = isinstance(exc, KeyError) and exc.args[:1] == ("optimizer",)
    chained = isinstance(exc, RuntimeError) and "entries in state dict" in str(exc)
    return in_optimizer_load and (single or chained)

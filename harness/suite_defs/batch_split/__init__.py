"""`batch-split`: the same RL batch trains the same however it is cut into micro-batches and laid out.

RL frameworks cut a batch of prompt + response samples their own way (micro-batch sizes, dynamic micro-batches by a
token budget) and aggregate its loss with their own code (token-mean over the global batch, seq-mean-token-mean,
seq-mean-token-sum, token-sum). Every cut and layout of a mode is judged against that mode's reference: the same
global batch as one micro-batch on one rank. Per step the loss, the gradient norm and the zero gradient elements,
every parameter after the last step, and the log-probs of a forward-only pass (as a framework's compute_log_prob).

The package: params.py (the parameters, the default matrix), judge.py (the checks), suite.py (cases and rank work).
"""

from harness.suite_defs.batch_split.params import BatchSplitParams

__all__ = ["BatchSplitParams", "BatchSplitSuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "BatchSplitSuite":
        from harness.suite_defs.batch_split.suite import BatchSplitSuite

        return BatchSplitSuite
    raise AttributeError(name)

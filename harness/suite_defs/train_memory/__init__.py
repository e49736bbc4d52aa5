"""`train-memory`: what a training rank holds, per phase, against the training-memory model and baselines.

Per case: build (model chunks, DDP grad buffers, optimizer) and each training step measured on every rank -
the heap high-water of the phase (memray, as ckpt-memory measures) and, on GPU ranks, the device's allocated
peak above what was allocated at the phase's start. Judged in the parent against the analytic model of
harness/checks/training_memory.py (build: weights + gradient buffers + master copies; first step: the
optimizer state it creates + the step's activations; later steps: the activations alone) and against the
stored baselines. The first step of a rank process pays one-time costs (lazy imports, allocator pools):
the case runs a priming step on a throwaway engine first, as ckpt-memory primes its saves.

The package: params.py (TrainMemoryParams), figures.py (bytes per phase, baseline key), judge.py (the model and
baseline checks), suite.py (the Suite the registry names: cases and rank work).
"""

from harness.suite_defs.train_memory.params import TrainMemoryParams

__all__ = ["TrainMemoryParams", "TrainMemorySuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "TrainMemorySuite":
        from harness.suite_defs.train_memory.suite import TrainMemorySuite

        return TrainMemorySuite
    raise AttributeError(name)

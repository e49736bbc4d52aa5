"""The harness process plans and judges a run without importing torch where no payload holds tensors: only its
ranks import it. On a 2-core box torch's import is ~3 s of CPU in every `harness run` and bisect step, spent
beside the fork server's own import of it."""

from __future__ import annotations

import json
import subprocess
import sys

# Suites whose rank payloads are numbers only (memory figures, step times, counters); the others judge tensors.
TORCH_FREE_SUITES = ("ckpt-memory", "train-memory", "step-perf")

PLAN = """
import json, sys
import harness.platform.backend as backend
backend.GPU_DRIVER_PATHS = ("/nonexistent/gpu-driver",)  # a host without a GPU driver, as CI's
from harness.driver import planned_run
for name in sys.argv[1:]:
    suite, params, cases = planned_run(name, None, 2, backend="auto")
    assert cases, name
    suite.check([], params)  # the suite's judges, imported and called
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def test_planning_and_judging_the_memory_and_time_suites_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", PLAN, *TORCH_FREE_SUITES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not imported, f"the harness process imported {imported[:5]} planning {TORCH_FREE_SUITES}; " \
        "import torch inside the function that needs it (or under TYPE_CHECKING for annotations)"

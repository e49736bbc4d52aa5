"""The harness process plans and judges a run without importing torch where no payload holds tensors: only its
ranks import it. On a 2-core box torch's import is ~3 s of CPU in every `harness run` and bisect step, spent
beside the fork server's own import of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Suites whose rank payloads are numbers only (memory figures, step times, counters); the others judge tensors.
TORCH_FREE_SUITES = ("ckpt-memory", "train-memory", "step-perf")

PLAN = """
import sys
import harness.platform.backend as backend
backend.GPU_DRIVER_PATHS = ("/nonexistent/gpu-driver",)  # a host without a GPU driver, as CI's
from harness.driver import plan
for name in sys.argv[1:]:
    planned = plan(name, None, 2, backend="auto")
    assert planned.cases, name
    planned.suite.check([], planned.params)  # the suite's judges, imported and called
"""


USER_ENGINE = """
from harness.engine_api import FSDP2Engine, McoreEngine


class Engine(McoreEngine):
    pass


class Sharded(FSDP2Engine):
    pass
"""

RESOLVE = """
from harness.driver import plan
from harness.engines import is_fsdp2, resolve_factory
for name in ("user_engine:Engine", "user_engine:Sharded", "mcore", "fsdp2"):
    resolve_factory(name)
    is_fsdp2(name)
plan("ckpt-memory", "tiny", 2, engine="user_engine:Engine", backend="gloo")
"""

# appended to each script: the torch modules the process imported, as its last line
REPORT = """
import json, sys
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def _torch_imported_by(script: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", script + REPORT, *args], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_engine_built_on_the_harness_engines_is_resolved_without_torch(tmp_path):
    """`--engine pkg:Engine` subclassing McoreEngine / FSDP2Engine (as a bisect's user engine does): the harness
    process imports it to refuse a missing one before any rank, and that must not import torch (2.4 s of CPU per
    bisect step measured)."""
    (tmp_path / "user_engine.py").write_text(USER_ENGINE)
    path = os.pathsep.join([str(tmp_path), *sys.path])
    imported = _torch_imported_by(RESOLVE, env={**os.environ, "PYTHONPATH": path})
    assert not imported, f"resolving an engine built on McoreEngine / FSDP2Engine imported {imported[:5]}; " \
        "import torch inside the function that needs it (or under TYPE_CHECKING for annotations)"


def test_planning_and_judging_the_memory_and_time_suites_imports_no_torch():
    imported = _torch_imported_by(PLAN, *TORCH_FREE_SUITES)
    assert not imported, f"the harness process imported {imported[:5]} planning {TORCH_FREE_SUITES}; " \
        "import torch inside the function that needs it (or under TYPE_CHECKING for annotations)"

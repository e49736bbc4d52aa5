"""Local bisect of a regression: a case, a metric and a threshold, over releases of a distribution (each in
a cached virtualenv) or over the commits of a local git checkout (a worktree put on the path).

search.py: the gate and the binary search over an ordered candidate list, thresholds, the table;
candidates.py: the candidates and the environments they run in; step.py: one step (`harness bisect-step`,
exit 0 good, 1 bad, 125 cannot tell - git bisect run's convention) and the JSON it hands back. Every
candidate is judged in a fresh process, so nothing imported for one leaks into the next. The command
itself is harness/commands/bisect_command.py.
"""

from harness.bisect.candidates import (
                                       CommitCandidates,
                                       Environment,
                                       PackageCandidates,
                                       Worktree,
                                       commits_between,
                                       expand_versions,
                                       index_versions,
                                       local_versions,
                                       pypi_versions,
                                       version_env,
)
from harness.bisect.search import (
                                       BAD,
                                       FIX,
                                       GOOD,
                                       REGRESSION,
                                       SKIP,
                                       VERDICTS,
                                       GateRefused,
                                       StepResult,
                                       Terms,
                                       Threshold,
                                       Tried,
                                       flip,
                                       flipped,
                                       format_table,
                                       gate,
                                       search,
)
from harness.bisect.step import StepSpec, judge_run, read_step_json, run_in, run_step, step_env, write_step_json

__all__ = ["BAD", "FIX", "GOOD", "REGRESSION", "SKIP", "VERDICTS", "CommitCandidates", "Environment", "GateRefused",
           "PackageCandidates", "StepResult", "StepSpec", "Terms", "Threshold", "Tried", "Worktree", "commits_between",
           "expand_versions", "flip", "flipped", "format_table", "gate", "index_versions", "judge_run",
           "local_versions", "pypi_versions", "read_step_json", "run_in", "run_step", "search", "step_env",
           "version_env", "write_step_json"]

"""The house as docs/architecture.md draws it: no import circle anywhere in harness/ (a judge never imports its
suite, recording sits above the driver, ...), and optional capabilities asked for with isinstance on a
Protocol, never with a hasattr probe (a typo would be a silent "no")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# hasattr / getattr-with-default probes of an attribute named in the code, that ask a third-party object (or
# version) and not a harness capability: (file, attribute) -> why. A new entry needs its reason.
THIRD_PARTY_PROBES = {
    ("harness/benchmark.py", "_timer"): "pytest-benchmark's fixture: a disabled benchmark has none",
    ("harness/bisect/candidates.py", "reason"): "urllib's URLError.reason",
    ("harness/cli.py", "_run_exitfuncs"): "CPython's atexit internals",
    ("harness/engines/base.py", "tensor_model_parallel"): "megatron's parameter attribute",
    ("harness/engines/cp_attention.py", "cp"): "megatron's pg_collection",
    ("harness/engines/experts.py", "allreduce"): "megatron's parameter attribute (unset: reduced with the dense ones)",
    ("harness/platform/without_te.py", "te_general_gemm"): "megatron-core moe_utils: defined where TE imports",
    ("harness/engines/cp_attention.py", "cp_group"): "megatron's PackedSeqParams",
    ("harness/engines/cp_attention.py", "qkv_format"): "megatron's PackedSeqParams",
    ("harness/engines/mcore.py", "decoder"): "megatron's model chunk (pipeline stages without one)",
    ("harness/engines/mcore.py", "share_embeddings_and_output_weights"): "megatron's model chunk",
    ("harness/engines/mcore.py", "mtp_process"): "megatron's model chunk (0.16's GPTModel has no MTP stage flag)",
    ("harness/engines/mcore_ckpt.py", "chained_optimizers"): "megatron's ChainedOptimizer",
    ("harness/engines/mcore_ckpt.py", "model_param_group_index_map"): "megatron's DistributedOptimizer",
    ("harness/engines/mcore_ckpt.py", "float16_groups"): "megatron's Float16OptimizerWithFloat16Params",
    ("harness/engines/mcore_ckpt.py", "fp32_from_float16_groups"): "megatron's Float16OptimizerWithFloat16Params",
    ("harness/engines/megatron_bridge.py", "HAVE_TE"): "megatron-core: Transformer Engine installed",
    ("harness/platform/cpu_layer.py", "te_general_gemm"): "megatron-core: defined only where Transformer Engine imports",
    ("harness/probes/ckpt_format.py", "size"): "torch DCP metadata entries",
    ("harness/probes/collectives.py", "_opname"): "torch's OpOverload",
    ("harness/probes/memory.py", "host_memory_stats"): "torch version probe",
    ("harness/probes/memory.py", "reset_peak_host_memory_stats"): "torch version probe",
    ("harness/suite_defs/ckpt_errors.py", "failures"): "torch's CheckpointException",
}
PROBE = re.compile(r"""\bhasattr\([^()]*,\s*["']([^"']+)["']\s*\)|\bgetattr\([^()]*,\s*["']([^"']+)["']\s*,""")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, module: str, is_pkg: bool, files: dict) -> list[str]:
    """The modules an import statement in `module` names; `from pkg import sub` names the submodule, not the
    package's __init__; a relative import resolved against `module`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative
        anchor = module.split(".") if is_pkg else module.split(".")[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
    return subs + ([base] if len(subs) < len(node.names) else [])


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (lazy and TYPE_CHECKING imports included: a reader
    follows them all)."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            graph[module].update(t for t in imported(node, module, is_pkg, files) if t in files and t != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_harness_has_no_import_circle():
    found = circles(import_graph(ROOT, "harness"))
    assert not found, "import circles in harness/ (break them: see docs/architecture.md, Rooms):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_a_planted_circle_is_found(tmp_path):
    pkg = tmp_path / "house"
    (pkg / "suite").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "suite" / "__init__.py").write_text("from house.suite.params import P\n")
    (pkg / "suite" / "params.py").write_text("P = 1\n")
    (pkg / "suite" / "judge.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from house.suite.suite import Suite\n")
    (pkg / "suite" / "suite.py").write_text("from house.suite import judge, params\n")
    graph = import_graph(tmp_path, "house")
    assert graph["house.suite.suite"] == {"house.suite.judge", "house.suite.params"}  # submodules, not the face
    assert circles(graph) == [["house.suite.judge", "house.suite.suite"]]
    (pkg / "suite" / "judge.py").write_text("from house.suite import params\n")
    assert circles(import_graph(tmp_path, "house")) == []



def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between rooms: a top-level module or package of harness/ (`harness.selection`, `harness.engines`)
    imports another where one of its modules does."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return {r: {t for t in targets if t in out} for r, targets in out.items()}


def test_harness_has_no_circle_between_rooms():
    """No room imports a room that imports it back: the suites' flags and dtypes sit below both the selection and
    the suites, so a suite's record command (selection) imports no suite back."""
    found = circles(rooms(import_graph(ROOT, "harness")))
    assert not found, "rooms of harness/ that import each other (move what both use below both):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_a_circle_between_rooms_is_found():
    graph = {"harness.selection": {"harness.suite_defs"}, "harness.suite_defs": set(),
             "harness.suite_defs.golden.figures": {"harness.selection"}}
    assert circles(rooms(graph)) == [["harness.selection", "harness.suite_defs"]]


def suites_importing_suites(graph: dict[str, set[str]], prefix: str = "harness.suite_defs") -> list[str]:
    """'a -> b' for every module of one suite that imports a module of another. A suite is a registered suite's
    module or package under `prefix`; the modules there that no suite owns (flags, agreement, ckpt_errors) are
    the shared room every suite may use."""
    from harness.suite_registry import SUITES

    owners = {spec.suite.split(":")[0] for spec in SUITES.values()}

    def suite_of(module: str) -> str | None:
        return next((o for o in owners if module == o or module.startswith(o + ".")), None)

    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if suite_of(m) and suite_of(t) and suite_of(m) != suite_of(t))


def test_no_suite_imports_another():
    found = suites_importing_suites(import_graph(ROOT, "harness"))
    assert not found, "a suite imports another (move what both use to a module of harness/suite_defs no suite " \
        "owns, or further down):\n" + "\n".join(found)


def test_a_suite_importing_another_is_found():
    graph = {"harness.suite_defs.golden.suite": {"harness.suite_defs.equivalence", "harness.suite_defs.agreement"},
             "harness.suite_defs.equivalence": {"harness.suite_defs.agreement"}}
    assert suites_importing_suites(graph) == ["harness.suite_defs.golden.suite -> harness.suite_defs.equivalence"]

# Third-party packages imported in a function, never at a module's top: the parent process stays free of them.
HEAVY = ("torch", "megatron", "mbridge", "transformer_engine", "transformers", "peft", "memray", "matplotlib", "scipy",
         "ruptures", "numpy")
# What `harness --help` and `harness report` never load (tests/test_cli.py, tests/test_toy_suite.py): the driver,
# the ranks, recording, bisect, power, and every module of a suite but its parameters.
MACHINERY = ("harness.driver", "harness.launch", "harness.recording", "harness.bisect", "harness.power")


def module_imports(root: Path, package: str) -> tuple[dict[str, set[str]], set[str], list[tuple[str, str, int]]]:
    """(module -> the package's modules it imports at its top; the modules that import a HEAVY package at their
    top; (module, target, line) of each import of the package's modules inside a function). TYPE_CHECKING imports
    count nowhere: they run for the type checker only."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    top: dict[str, set[str]] = {m: set() for m in files}
    heavy: set[str] = set()
    deferred: list[tuple[str, str, int]] = []

    def walk(module: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = imported(child, module, files[module].name == "__init__.py", files)
                ours = [t for t in names if t in files]
                if in_function:
                    deferred.extend((module, t, child.lineno) for t in ours)
                else:
                    top[module].update(ours)
                    if any(t.split(".")[0] in HEAVY for t in names):
                        heavy.add(module)
            walk(module, child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for module, path in files.items():
        walk(module, ast.parse(path.read_text(), str(path)), False)
    for module in files:  # importing a package runs its __init__ first
        parts = module.split(".")
        top[module].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in files)
    return top, heavy, deferred


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def unjustified_deferrals(root: Path, package: str, entry: str, params: set[str]) -> list[str]:
    """Imports of the package's modules inside a function that could be at the module's top: the target's top
    imports no HEAVY package (itself or through the modules it imports at their tops), and either the importing
    module is not loaded by `entry` (the CLI) and `params` (the suites' parameter modules, which it loads) or the
    target loads no machinery (MACHINERY, a suite's code)."""
    top, heavy, deferred = module_imports(root, package)
    # the parser imports every suite's parameters by name (harness/suite_flags.py) to declare their flags
    loaded_by_entry = closure(top, entry).union(*(closure(top, p) for p in params if p in top))

    def machinery(m: str) -> bool:
        suite_code = m.startswith("harness.suite_defs.") and m.count(".") >= 3 and m not in params
        return suite_code or any(m == p or m.startswith(p + ".") for p in MACHINERY)

    out = []
    for module, target, line in deferred:
        reach = closure(top, target)
        if reach & heavy or (module in loaded_by_entry and any(machinery(m) for m in reach)):
            continue
        out.append(f"{module}:{line} imports {target} in a function")
    return sorted(set(out))


def test_harness_imports_its_own_modules_at_the_top_unless_that_would_load_torch_or_the_suites():
    """A harness module imports the harness's modules at its top, so its header says what it depends on; the two
    reasons to import one in a function: it imports torch (or another HEAVY package) at its top, or the parser
    would load the driver, the ranks or a suite's code (`harness --help`, `harness report` stay light)."""
    from harness.suite_registry import SUITES

    params = {name for spec in SUITES.values() for t in spec.params
              for module in [t.partition(":")[0]] for name in (module.rpartition(".")[0], module)}
    found = unjustified_deferrals(ROOT, "harness", "harness.cli", params)
    assert not found, "move these imports to the top of their module:\n" + "\n".join(found)


def test_an_import_in_a_function_without_a_reason_is_found(tmp_path):
    pkg = tmp_path / "harness"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("def main():\n    from harness import driver\n    from harness import light\n")
    (pkg / "driver.py").write_text("")
    (pkg / "light.py").write_text("")
    (pkg / "ranks.py").write_text("import torch\n")
    (pkg / "engine.py").write_text("def build():\n    from harness import ranks, light\n")
    assert unjustified_deferrals(tmp_path, "harness", "harness.cli", set()) == [
        "harness.cli:3 imports harness.light in a function", "harness.engine:2 imports harness.light in a function"]


# where the megatron-core / bridge releases differ: every version probe of theirs lives there (harness/upstream.py)
UPSTREAM = "harness/upstream.py"


def test_no_hasattr_capability_probe_in_harness():
    probes = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == UPSTREAM:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in PROBE.finditer(line):
                if (rel, m.group(1) or m.group(2)) not in THIRD_PARTY_PROBES:
                    probes.append(f"{rel}:{n}: {line.strip()}")
    assert not probes, ("capability probes by attribute name; ask with isinstance on a typing.Protocol "
                        "(harness/suite_defs/__init__.py, harness/engines/base.py) or, for a third-party object, list "
                        "it in THIRD_PARTY_PROBES with the reason:\n" + "\n".join(probes))


def test_installed_releases_are_compared_only_in_the_upstream_and_stack_modules():
    """A release of megatron-core or a bridge compared anywhere but harness/upstream.py (feature probes, the known
    defects) and harness/stack.py (the tested range) is a version difference reached around the one place for them;
    elsewhere versions appear in messages only."""
    compare = re.compile(r"Version\(\s*(metadata\.)?version\(")
    stray = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "harness").rglob("*.py"))
             if p.relative_to(ROOT).as_posix() not in (UPSTREAM, "harness/stack.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
    assert not stray, "compare releases in harness/upstream.py:\n" + "\n".join(stray)


def test_the_probe_pattern_sees_both_kinds():
    assert PROBE.search('if hasattr(engine, "saved_metadata"):').group(1) == "saved_metadata"
    assert PROBE.search('fresh = getattr(suite, "fresh_pool", False)').group(2) == "fresh_pool"
    assert not PROBE.search("value = getattr(module, attr)")  # a lookup by a computed name, no default
    assert not PROBE.search('value = getattr(module, "name")')  # no default: raises, asks nothing

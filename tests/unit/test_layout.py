"""The code's layout holds: the notebook side loads without torch, runs go through the session.

These read the package itself (a fresh interpreter, the source files); no ranks start.
"""

import ast
import pathlib
import subprocess
import sys

import labkit

PACKAGE = pathlib.Path(labkit.__file__).parent
HEAVY = ("torch", "matplotlib", "ipywidgets")


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [name for name in done.stdout.strip().split(",") if name]


def test_the_notebook_side_loads_without_torch_matplotlib_or_ipywidgets():
    code = (
        "import labkit, labkit.lab, labkit.magics\n"
        "from labkit import Lab, TrainReport, TrainingRun, MeshSpec\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "shell.run_line_magic('load_ext', 'labkit')\n"
        "lab = Lab(ranks=4)\n"
        "from labkit.spec.train_config import resolve\n"
        "resolve(4, strategy='fsdp+tp', model='gpt')\n"
    )
    assert _loaded_after(code) == []


def test_the_dashboard_loads_its_libraries_when_first_used():
    assert set(_loaded_after("import labkit.views.dashboard")) >= {"matplotlib", "ipywidgets"}


def _attribute_reads(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            yield node.value.id, node.attr, node.lineno


def test_no_module_reaches_into_the_session_or_the_lab():
    offences = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "session.py":
            continue
        for owner, attribute, line in _attribute_reads(path):
            if owner in ("session", "lab") and attribute.startswith("_"):
                offences.append(f"{path.relative_to(PACKAGE)}:{line} {owner}.{attribute}")
    assert offences == []


def test_the_rank_side_is_the_only_one_importing_torch_at_module_level():
    notebook_side = ["spec", "runs", "views", "cluster", "line"]
    offences = []
    for folder in notebook_side:
        for path in (PACKAGE / folder).rglob("*.py"):
            if path.name == "process_host.py":
                continue  # it preloads torch into the ranks it forks, on purpose
            tree = ast.parse(path.read_text())
            for node in tree.body:  # module level only: functions may import on the ranks
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for name in names:
                    if name.split(".")[0] == "torch" or name.startswith("labkit.rank.") and name not in (
                        "labkit.wire.entry", "labkit.rank.bench"
                    ):
                        offences.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert offences == []


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def _type_only_imports(tree: ast.AST) -> set[ast.AST]:
    """The imports under ``if TYPE_CHECKING:``: read by the type checker, never run."""
    guarded = [node for node in ast.walk(tree) if isinstance(node, ast.If)
               and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")]
    return {inner for node in guarded for statement in node.body for inner in ast.walk(statement)}


def _imports_between_modules() -> dict[str, set[str]]:
    """labkit module -> the labkit modules it imports, at module level or inside functions.

    Imports for annotations only (``if TYPE_CHECKING:``) do not count: they never run, so they tie
    no module to another when the package loads."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text())
        type_only = _type_only_imports(tree)
        for node in ast.walk(tree):
            if node in type_only:
                continue
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: a relative import (labkit imports by full name)"
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def _cycle_from(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order), or [] when there is none."""
    state, path = {}, []

    def visit(module: str) -> list[str]:
        state[module], path[len(path):] = "open", [module]
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def test_no_import_cycle_between_labkit_modules():
    # Imports inside functions count too: a cycle there still ties the modules together.
    cycle = _cycle_from(_imports_between_modules())
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_imports_for_annotations_only_are_told_apart():
    tree = ast.parse("from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    import sys\n")
    assert {ast.unparse(node) for node in _type_only_imports(tree) if isinstance(node, ast.Import)} == {"import sys"}


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle_from({"a": {"b"}, "b": set()}) == []


# The parts of labkit, lowest first: each imports only parts below it (or itself). A new package or
# top-level module gets its place here, which is where the house plan in the docs says it sits.
LAYERS = (
    ("units",),  # numbers and sizes as people read them
    ("wire",),  # what both sides share: functions sent to ranks, store keys, what ranks send back
    ("zoo",),  # the lab's own models
    ("torch_support",),  # torch's private API, pinned staging, optimizers
    ("strategies",),  # the ways of splitting the work: declarations and their rank side
    ("spec",),  # what a user asks for, checked without torch
    ("line",),  # one outbound HTTPS line from a site to the hub: frames, sessions, TLS, tokens
    ("rank",),  # the rank's runtime, training loop and instruments
    ("loop_marks",),  # labkit.log and labkit.step: what user code tells the rank's instruments
    ("cluster",),  # engines, launchers, placement, health: the notebook's side of the ranks
    ("views",),  # tables, figures and dashboards
    ("runs",),  # work in flight: training runs, tasks, checkpoints, recovery
    ("session",),  # one lab's state
    ("sites",),  # machines that joined over HTTPS, each a session of its own
    ("window",),  # the ranks' namespaces and debuggers, seen from the notebook (a part of Lab)
    ("lab",),  # the public Lab object
    ("magics",),  # the %lab magics
    ("labkit", "__main__"),  # the package's front door and command line
)


def _part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "labkit"


def test_parts_depend_in_one_direction():
    level = {part: index for index, layer in enumerate(LAYERS) for part in layer}
    graph = _imports_between_modules()
    unplaced = sorted({_part_of(module) for module in graph} - set(level))
    assert unplaced == [], f"give these parts their place in LAYERS: {unplaced}"
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if level[_part_of(target)] > level[_part_of(module)])
    assert upward == [], "imports from a higher part: " + "; ".join(upward)

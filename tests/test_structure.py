"""The package's shape, read from the source (imports inside functions included):

- no import cycle among jaxtrain's modules;
- the rooms (packages and top-level modules) import only rooms on lower floors (``FLOORS``), so data flows one way:
  config -> parallel facts -> model / optimizer -> parallel layout -> step -> loop -> planner -> commands;
- every package says in its docstring what lives there and what it may import;
- no module over 500 lines (kernel files: 600), no function over 80 lines, in jaxtrain/;
- mesh axes named through ``jaxtrain.parallel.dims.Axis``, never as bare strings where a mesh axis is meant.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "jaxtrain")
MAX_LINES, MAX_KERNEL_LINES, MAX_FUNCTION_LINES = 500, 600, 80

# Rooms from the bottom up; a room may import its own modules and those of rooms on lower floors only. A room is a
# package or top-level module of jaxtrain, or a module or subpackage named in FLOORS (``jaxtrain.parallel.dims``: the
# device-free parallel facts sit below the config that reads them; the kernels' and the planner's families, each
# package's __init__ above the families it gathers).
FLOORS = [
    {"jaxtrain", "errors", "log"},  # the package's __init__ (its version), error types, log lines
    {"kernels.flash"},  # flash attention kernels and the XLA reference: nothing of jaxtrain
    {"kernels.gmm"},  # the grouped matmul
    {"kernels"},  # the kernels' entry points
    {"kernels.bench"},  # the kernels' benchmarks (their callers read any data)
    {"parallel.dims"},  # axes, sizes, derived parallel facts: no JAX
    {"rundir"},  # run-directory file names, the run lock, metrics.jsonl / summary.json
    {"config"},  # the typed config tree, loading, validation: no JAX
    {"cluster"},  # processes, nodes and links: jax.distributed, the GPU driver, process-level JAX settings
    {"models"},  # model families, logical axes only
    {"optim"},  # optimizer and train state
    {"parallel"},  # the layout on devices, parallelism applied to the model
    {"checkpoint", "data", "observe"},
    {"train"},  # the step and the loop
    {"planner.cost"},  # compiled programs read as data, the cost model, the hardware's figures
    {"planner.search"},  # plan's candidate meshes, each compiled; the table
    {"planner.auto", "planner.xla_gpu"},  # mesh.auto's choice; XLA:GPU's compile without a GPU
    {"planner"},  # jaxtrain plan's entry point
    {"health", "sweep", "hf"},
    {"commands"},
    {"cli"},
    {"__main__"},
]
ROOMS = set().union(*FLOORS)


def _modules() -> dict[str, str]:
    """Module name -> path, for every module of the jaxtrain package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The jaxtrain modules ``name`` imports anywhere in its file (``from jaxtrain import x`` names module x)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    found.discard(name)
    return found


def _room(module: str) -> str:
    """The room of a module: the longest of its enclosing names that FLOORS names, else its package or top-level
    module under jaxtrain."""
    rest = module.removeprefix("jaxtrain").removeprefix(".")
    parts = rest.split(".")
    named = [".".join(parts[:i]) for i in range(len(parts), 1, -1) if ".".join(parts[:i]) in ROOMS]
    return named[0] if named else parts[0] if rest else "jaxtrain"


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    modules = _modules()
    # The package's __init__ and the CLI entry point sit above everything; a package imports its own modules.
    graph = {name: {m for m in _imports(name, path, set(modules)) if not name.startswith(m + ".") and m != "jaxtrain"}
             for name, path in modules.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _upward_imports(modules: dict[str, str]) -> list[str]:
    bad = []
    for name, path in sorted(modules.items()):
        room = _room(name)
        for target in sorted(_imports(name, path, set(modules))):
            other = _room(target)
            if other != room and _floor(other) >= _floor(room):
                bad.append(f"{name} (room {room}, floor {_floor(room)}) imports {target} (room {other}, "
                           f"floor {_floor(other)})")
    return bad


def test_every_room_is_on_a_floor():
    rooms = {_room(m) for m in _modules()}
    missing = sorted(r for r in rooms if not any(r in floor for floor in FLOORS))
    assert not missing, f"rooms not placed in FLOORS: {missing}"


def test_rooms_import_only_rooms_below_them():
    bad = _upward_imports(_modules())
    assert not bad, "imports against the floors (tests/test_structure.py FLOORS):\n" + "\n".join(bad)


def test_the_kernels_import_nothing_else_of_jaxtrain():
    """``jaxtrain.kernels`` is a leaf that another project could vendor: its modules (benchmarks included: their
    callers read the data) import only ``jaxtrain.kernels``."""
    modules = _modules()
    bad = [f"{name} imports {target}" for name, path in sorted(modules.items()) if name.startswith("jaxtrain.kernels")
           for target in sorted(_imports(name, path, set(modules))) if not target.startswith("jaxtrain.kernels")]
    assert not bad, "the kernels import the rest of jaxtrain:\n" + "\n".join(bad)


# The kinds of state that ride the step beside the gradients (FP8 amax histories, router statistics) are declared in
# jaxtrain.models.sidestate; the step, the pipelines and the checkpoint package ask it and import no kind's module.
KIND_MODULES = {"jaxtrain.models.fp8", "jaxtrain.models.fp8_experts", "jaxtrain.models.moe", "jaxtrain.models.routing"}


def test_the_step_pipelines_and_checkpoints_name_no_kind_of_side_state():
    modules = _modules()
    askers = [n for n in modules if n in ("jaxtrain.train.step", "jaxtrain.parallel.pipeline",
                                          "jaxtrain.parallel.pipeline_1f1b") or n.startswith("jaxtrain.checkpoint")]
    assert len(askers) >= 5
    bad = []
    for name in sorted(askers):
        for target in sorted(_imports(name, modules[name], set(modules))):
            checkpoint_to_models = name.startswith("jaxtrain.checkpoint") and target.startswith("jaxtrain.models")
            if target in KIND_MODULES or checkpoint_to_models:
                bad.append(f"{name} imports {target}")
    assert not bad, "side state named outside jaxtrain.models.sidestate:\n" + "\n".join(bad)


def _members(path: str, cls: str) -> set[str]:
    """Names of the public methods and properties class ``cls`` of the module at ``path`` defines."""
    node = next(n for n in ast.parse(open(path).read()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


def test_layout_forwards_no_parallel_fact():
    """One way to each fact: ``layout.dims.stages``, never a ``Layout.stages`` that repeats ``ParallelDims``."""
    parallel = os.path.join(PACKAGE, "parallel")
    both = _members(os.path.join(parallel, "layout.py"), "Layout") & _members(os.path.join(parallel, "dims.py"),
                                                                            "ParallelDims")
    assert not both, f"Layout repeats ParallelDims' {sorted(both)}: callers ask layout.dims"


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The check itself: a model module importing the train step is reported."""
    bad_file = tmp_path / "llama.py"
    bad_file.write_text("from jaxtrain.train import step\n")
    modules = {"jaxtrain.models.llama": str(bad_file), "jaxtrain.train.step": str(bad_file)}
    assert any("jaxtrain.models.llama" in line for line in _upward_imports(modules))


@pytest.mark.parametrize("package", sorted(os.path.relpath(root, PACKAGE) for root, _, files in os.walk(PACKAGE)
                                            if root != PACKAGE and "__init__.py" in files))
def test_every_package_says_what_lives_there_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, package, "__init__.py")).read())) or ""
    assert len(doc.split()) >= 25, f"jaxtrain/{package}/__init__.py: say in a paragraph what lives there"
    assert "import" in doc, f"jaxtrain/{package}/__init__.py: say what the package may import"


def test_no_module_over_the_line_cap():
    long = {}
    for path in _modules().values():
        cap = MAX_KERNEL_LINES if os.sep + "kernels" + os.sep in path else MAX_LINES
        if (n := len(open(path).readlines())) > cap:
            long[os.path.relpath(path, REPO)] = n
    assert not long, f"modules over {MAX_LINES} lines ({MAX_KERNEL_LINES} for kernels): {long}"


def test_no_function_over_80_lines():
    long = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


AXIS_NAMES = {"data", "stage", "fsdp", "context", "tensor", "expert"}
# Calls whose string arguments name mesh axes (specs, collectives, sizes).
AXIS_CALLS = {"PartitionSpec", "P", "axis_index", "psum", "pmean", "pmax", "all_gather", "ppermute", "all_to_all",
              "psum_scatter", "axis_size", "size", "crosses_nodes"}
# Where a string equal to an axis name is no mesh axis: (module, the string).
NOT_AXES = {("jaxtrain/observe/stragglers.py", "data")}


def _axis_strings(path: str) -> list[tuple[int, str]]:
    """(line, name) of string constants equal to a mesh axis name used as one: a subscript (``sizes["fsdp"]``), a
    comparison (``== "context"``), a ``.get(name, 1)`` or an argument of a spec or collective call."""
    tree = ast.parse(open(path).read())
    hits = []
    for node in ast.walk(tree):
        consts = []
        if isinstance(node, ast.Subscript):
            consts = [node.slice]
        elif isinstance(node, ast.Compare):
            consts = [node.left, *node.comparators]
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in AXIS_CALLS or (func == "get" and len(node.args) == 2
                                      and isinstance(node.args[1], ast.Constant) and node.args[1].value == 1):
                consts = list(node.args)
        for c in consts:
            for sub in ast.walk(c):
                if isinstance(sub, ast.Constant) and sub.value in AXIS_NAMES:
                    hits.append((sub.lineno, sub.value))
    return hits


def test_mesh_axes_are_named_through_the_axis_enum():
    allowed_files = {os.path.join("jaxtrain", "parallel", "dims.py"), os.path.join("jaxtrain", "config", "tree.py")}
    bad = []
    for path in _modules().values():
        rel = os.path.relpath(path, REPO)
        if rel in allowed_files:
            continue
        bad += [f"{rel}:{line} {name!r}" for line, name in _axis_strings(path) if (rel, name) not in NOT_AXES]
    assert not bad, f"mesh axes named by bare strings (use jaxtrain.parallel.dims.Axis): {bad}"


def test_the_axis_string_check_sees_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('sizes = {}\nn = sizes["fsdp"]\nk = sizes.get("context", 1)\nok = x == "stage"\n')
    assert [name for _, name in _axis_strings(str(f))] == ["fsdp", "context", "stage"]

"""The layout keeps the architecture: role packages on floors, imports only downward, no circle.

Every import in pipeinfer/ counts, those inside functions too: an import deferred to a function is still a
dependency of the module (it only moves the failure to the first call).
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pipeinfer"

# floor of each role package: a module may import its own package and any package on a lower floor; packages that
# share a floor do not import each other. The processes a newcomer sees in `ps` have rooms of their own: the HTTP
# server (frontend), the supervisor, and rank 0's feeders beside the ranks' loops; serving is the seam they share
FLOORS = {"core": 0, "engine": 1, "wire": 1, "drafters": 2, "serving": 2, "decide": 3, "ranks": 4, "feeders": 5,
          "twin": 5, "supervisor": 6, "frontend": 6, "cli": 7}
ROOT_MODULES = {"pipeinfer": -1, "pipeinfer.__main__": 8}   # the version (anyone), `python -m pipeinfer` (no one)
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The pipeinfer modules `name` imports (a package's __init__ counts as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            if c in known and c != name:
                found.add(c)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def floor(module: str) -> tuple[str, int]:
    if module in ROOT_MODULES:
        return module, ROOT_MODULES[module]
    role = module.split(".")[1]
    assert role in FLOORS, f"{module}: pipeinfer/{role} is not a role package (FLOORS)"
    return role, FLOORS[role]


def test_every_module_lives_in_a_role_package():
    flat = [m for m in modules() if m not in ROOT_MODULES and m.count(".") < 2 and m.split(".")[1] not in FLOORS]
    assert not flat, f"modules outside the role packages: {flat}"
    for role in FLOORS:
        doc = ast.get_docstring(ast.parse((PKG / role / "__init__.py").read_text()))
        assert doc and len(doc) > 100, f"pipeinfer/{role}/__init__.py needs a paragraph on what it owns"


def test_imports_go_only_downward():
    upward = []
    for module, targets in graph().items():
        role, level = floor(module)
        for t in targets:
            t_role, t_level = floor(t)
            if t_role != role and t_level >= level:
                upward.append(f"{module} -> {t}")
    assert not upward, "imports that do not go down a floor:\n" + "\n".join(sorted(upward))


def test_the_import_graph_has_no_circle():
    g = graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import circle: " + " -> ".join(cycle))


def test_the_graph_check_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    # the checks above on a package made to break them: core imports cli (upward), and back (a circle)
    fake = tmp_path / "pipeinfer"
    for role in ("core", "cli"):
        (fake / role).mkdir(parents=True)
        (fake / role / "__init__.py").write_text(f'"""{role}"""\n')
    (fake / "__init__.py").write_text("")
    (fake / "core" / "a.py").write_text("def f():\n    from ..cli import b\n")
    (fake / "cli" / "b.py").write_text("from ..core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    with pytest.raises(AssertionError, match="pipeinfer.core.a -> pipeinfer.cli.b"):
        test_imports_go_only_downward()
    with pytest.raises(pytest.fail.Exception, match="import circle"):
        test_the_import_graph_has_no_circle()


def test_no_long_functions_or_classes():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            n_lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n_lines > MAX_FUNCTION_LINES:
                long.append(f"{name}.{node.name}: {n_lines} lines")
            if isinstance(node, ast.ClassDef) and n_lines > MAX_CLASS_LINES:   # a hard limit: no class is exempt
                long.append(f"{name}.{node.name}: class of {n_lines} lines")
    assert not long, "\n".join(long)


def test_no_drafter_is_asked_what_it_is_with_getattr():
    """What a drafter is (in series or beside the pipeline, remote, its limits) is declared on the Drafter protocol
    (drafters/drafter.py), never probed: no getattr or hasattr on anything named a drafter."""
    probes = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and "drafter" in ast.unparse(node.args[0]).lower()):
                probes.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "\n".join(probes)


BLOCK = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mpi4py', 'llama_cpp'):
            raise ImportError(f'{name} is unimportable in this test')
sys.meta_path.insert(0, Refuse())
"""


def test_the_twin_runs_with_mpi_and_llama_cpp_unimportable():
    code = BLOCK + (
        "import pipeinfer.twin, pipeinfer.twin.cluster, pipeinfer.twin.sim, pipeinfer.twin.plan, pipeinfer.decide.head\n"
        "from pipeinfer.twin.cluster import Cluster, Link, StageCost\n"
        "from pipeinfer.twin.sim import simulate\n"
        "from pipeinfer.decide.genconfig import GenConfig\n"
        "c = Cluster([StageCost([10.0], 1.0)] * 3, [Link()] * 3, 64, 2.0)\n"
        "res = simulate(c, GenConfig(mode='pipeinfer', n_predict=16, p_recovery=None))\n"
        "assert res.stats.n_generated == 16\n"
        "try:\n    import mpi4py\nexcept ImportError:\n    print('clean')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


def test_the_decisions_import_no_mpi_nor_llama_cpp():
    """decide/ is what the ranks and the twin share: every module of it imports with mpi4py and llama_cpp
    unimportable, and none names either."""
    room = sorted(m for m in modules() if m.startswith("pipeinfer.decide"))
    assert len(room) >= 5, room
    named = [f"{m} imports {t}" for m in room for t in sorted(top_imports(modules()[m]) & {"mpi4py", "llama_cpp"})]
    assert not named, named
    code = BLOCK + "".join(f"import {m}\n" for m in room) + "print('clean')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


def test_the_http_server_imports_no_mpi_and_only_the_command_line_imports_it():
    """The HTTP server (frontend/) runs beside rank 0 or in a supervisor: every module of it imports with mpi4py
    unimportable, and nothing below the command line imports it."""
    front = sorted(m for m in modules() if m.startswith("pipeinfer.frontend"))
    code = BLOCK.replace("('mpi4py', 'llama_cpp')", "('mpi4py',)") + "".join(f"import {m}\n" for m in front) + \
        "print('clean')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]
    importers = sorted(m for m, targets in graph().items() if not m.startswith("pipeinfer.frontend")
                       and any(t.startswith("pipeinfer.frontend") for t in targets))
    assert all(m.startswith("pipeinfer.cli") for m in importers), importers


# ---------------------------------------------------------------- the walls around the package
REPO = PKG.parent
TESTS, LAUNCH = REPO / "tests", REPO / "launch"


def top_imports(path: Path) -> set[str]:
    """The first component of every absolute import in a file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


def test_no_test_module_imports_another():
    """What several test modules share lives in helper modules (helpers, toy, lanes, link_fakes, ...)."""
    bad = [f"{p.name} imports {m}" for p in sorted(TESTS.glob("*.py")) for m in sorted(top_imports(p))
           if m.startswith("test_")]
    assert not bad, "\n".join(bad)


def test_launch_never_imports_the_tests():
    """Benchmarks share what they need with the tests through launch/harness.py, and run tests/faults.py as a
    program: no script of launch/ imports a module of tests/ or puts tests/ on its path."""
    test_side = {p.stem for p in TESTS.glob("*.py")} - {p.stem for p in LAUNCH.rglob("*.py")}
    bad = [f"{p.name} imports {m}" for p in sorted(LAUNCH.rglob("*.py")) for m in sorted(top_imports(p) & test_side)]
    bad += [f"{p.name} puts tests/ on its path" for p in sorted(LAUNCH.rglob("*.py"))
            if re.search(r"sys\.path.*[\"']tests[\"']", p.read_text())]
    assert not bad, "\n".join(bad)


def docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if doc := ast.get_docstring(node):
                yield doc


def test_every_module_path_named_in_a_docstring_exists():
    """A docstring that names a file (`decide/scheduler.py`, `server/app.py`) names one that is there: a path
    relative to the package, the repository or any package folder."""
    files = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py") if ".git" not in p.parts}
    files |= {f.split("/", 1)[1] for f in list(files) if f.startswith("pipeinfer/")}
    ends = {f.rsplit("/", 1)[-1] for f in files} | {"/".join(f.split("/")[-2:]) for f in files}
    missing = []
    for name, path in modules().items():
        for doc in docstrings(path):
            for ref in re.findall(r"(?<![\w/.-])((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", doc):
                if ref not in files and ref not in ends:
                    missing.append(f"{name}: {ref}")
    assert not missing, "docstrings naming files that are not there:\n" + "\n".join(sorted(set(missing)))


def test_both_pipes_implement_the_port():
    """decide/port.PipePort is declared once and both pipes implement it: the MPI ranks' Pipeline and the twin's
    SimPipeline have every member it names, with the same parameters (the scheduler and executor use no other)."""
    import inspect

    from pipeinfer.decide.port import PipePort
    from pipeinfer.ranks.pipeline import Pipeline
    from pipeinfer.twin.sim import SimPipeline
    members = [n for n in vars(PipePort) if not n.startswith("_")] + ["in_flight"]
    assert {"launch", "set_sampling", "kv", "cancel", "result_ready", "next_result", "distributed"} <= set(members)
    for pipe in (Pipeline, SimPipeline):
        init = inspect.getsource(pipe.__init__)
        for name in members:
            assert hasattr(pipe, name) or f"self.{name}" in init, f"{pipe.__name__} lacks {name}"
            port_member = getattr(PipePort, name, None)
            if inspect.isfunction(port_member):
                assert (list(inspect.signature(getattr(pipe, name)).parameters)
                        == list(inspect.signature(port_member).parameters)), f"{pipe.__name__}.{name}"

"""The package's import graph, read from the source (nothing is imported): no import circle, no
layer importing a layer above it, nothing from benchmarks/, and every internal import resolvable.

Function-level imports count like module-level ones: a lazy import still ties the two modules
together. Each layer may import its own modules and the layers listed before it.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatrain_ray")

LAYERS = [
    ("config", ("megatrain_ray", "megatrain_ray.config", "megatrain_ray.errors", "megatrain_ray.yaml_strict",
                "megatrain_ray.progress")),
    ("model", ("megatrain_ray.model",)),
    ("data", ("megatrain_ray.data",)),
    ("io", ("megatrain_ray.io",)),
    ("engine", ("megatrain_ray.engine",)),
    ("orchestration", ("megatrain_ray.orchestration",)),
    ("face", ("megatrain_ray.cli", "megatrain_ray.plot", "megatrain_ray.bench", "megatrain_ray.hostmem",
              "megatrain_ray.lora_export")),
]
"""Bottom to top. The engine reads weights and checkpoints through io (the store's load_into), so
io sits below it and never imports it; io's hf_io names the tokenizer files of data."""


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py file under megatrain_ray/."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> list[tuple[int, str]]:
    """(line, imported name) of every import statement in the file, at any depth; relative imports
    resolved, ``from X import name`` giving ``X.name`` when that is a module of the package."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else base))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {name for _, name in _imports(m, p) if name in MODULES and name != m} for m, p in MODULES.items()}


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "megatrain_ray" and module.startswith(prefix + "."))
            if matches and len(prefix) > best:
                best, rank = len(prefix), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer of LAYERS; add it to the table in {__file__}")
    return rank


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_upward_import():
    bad = []
    for m, path in MODULES.items():
        for line, name in _imports(m, path):
            if name in MODULES and _layer(name) > _layer(m):
                bad.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line}: {m} ({LAYERS[_layer(m)][0]}) "
                           f"imports {name} ({LAYERS[_layer(name)][0]})")
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_internal_imports_resolve():
    """An import of megatrain_ray.X names a module or package that exists (catches stale paths)."""
    bad = [f"{m}:{line}: {name}" for m, p in MODULES.items() for line, name in _imports(m, p)
           if (name == "megatrain_ray" or name.startswith("megatrain_ray.")) and name not in MODULES]
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)


def test_nothing_from_benchmarks_and_no_dynamic_imports():
    """benchmarks/ is outside the package; and every import is a statement, so the graph above is whole."""
    bad = []
    for m, path in MODULES.items():
        tree = ast.parse(open(path).read(), path)
        for line, name in _imports(m, path):
            if name == "benchmarks" or name.startswith("benchmarks."):
                bad.append(f"{m}:{line}: imports {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in ("import_module", "__import__", "spec_from_file_location"):
                    bad.append(f"{m}:{node.lineno}: {called}(...)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["model", "engine", "engine/store", "engine/prefetch", "engine/compute",
                                     "engine/sink", "data", "io", "orchestration"])
def test_subpackages_say_what_lives_there_and_import_nothing(package):
    path = os.path.join(ROOT, package, "__init__.py")
    tree = ast.parse(open(path).read(), path)
    assert ast.get_docstring(tree), f"megatrain_ray/{package}/__init__.py needs a docstring"
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], \
        f"megatrain_ray/{package}/__init__.py imports something; import the submodules directly instead"


def test_error_types_live_in_errors_py():
    """Every exception class of the package is defined in megatrain_ray/errors.py (one place to read
    what a user can be told); other modules import them from there."""
    errors = ast.parse(open(MODULES["megatrain_ray.errors"]).read())
    known = {n.name for n in errors.body if isinstance(n, ast.ClassDef)}
    roots = known | {"Exception", "BaseException", "KeyboardInterrupt", "RuntimeError", "ValueError"}
    bad = []
    for m, path in MODULES.items():
        if m == "megatrain_ray.errors":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & roots:
                    bad.append(f"{m}:{node.lineno}: class {node.name}({', '.join(sorted(bases))})")
    assert not bad, "exception classes outside megatrain_ray/errors.py:\n" + "\n".join(bad)

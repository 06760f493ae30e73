"""The house plan: each module imports only from its own layer or the layers below it, and no module is part of
an import circle. Read from the source (AST), so function-level ("lazy") imports and imports under
`TYPE_CHECKING` count too: a lazy import that goes up is still an upward dependency.

Layers, top to bottom:

    4  interfaces      cli, tui, server, benchmarks (and the repository's apps/ and bench/)
    3  public calls    `cortexstream` (load, generate, stream_generate, batch_generate, perplexity): generation/,
                       evaluation/
    2  engine          engine/ (scheduler, block manager, runner, policy runtime, sampling, prompts, text stream,
                       clients) and c2c/ (fusion entered through a per-sequence hook)
    1  KV, policies    kv/ (arena, allocator, caches) and policies/ (pure selection)
    0  foundation      models/, port/, kernels/, backend, errors, atomic_files, the learned networks of
                       compression/ and sidecar/

Training (`cortexstream.training`) sits beside the product: it may import anything, and only interfaces (and
training itself) may import it, so nothing in the request path depends on training code.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cortexstream", "apps", "bench")
TRAINING = "cortexstream.training"
INTERFACES = 4

# Module-name prefix -> layer; the longest matching prefix decides.
LAYER_OF_PREFIX: dict[str, int] = {
    "cortexstream.errors": 0,
    "cortexstream.backend": 0,
    "cortexstream.atomic_files": 0,
    "cortexstream.models": 0,
    "cortexstream.port": 0,
    "cortexstream.kernels": 0,
    "cortexstream.compression": 0,
    "cortexstream.sidecar": 0,
    "cortexstream.kv": 1,
    "cortexstream.policies": 1,
    "cortexstream.engine": 2,
    "cortexstream.c2c": 2,
    "cortexstream": 3,  # the package itself: the public calls, imported lazily in __getattr__
    "cortexstream.generation": 3,
    "cortexstream.evaluation": 3,
    "cortexstream.cli": 4,
    "cortexstream.tui": 4,
    "cortexstream.server": 4,
    "cortexstream.benchmarks": 4,
    "cortexstream.pytest_openblas": 4,  # a pytest plugin
    "apps": 4,
    "bench": 4,
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            modules[module_name(path)] = path
    return modules


def layer_of(module: str) -> int | None:
    """The layer of a module, or None for training (which stands beside the layers)."""
    if module == TRAINING or module.startswith(TRAINING + "."):
        return None
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYER_OF_PREFIX:
            return LAYER_OF_PREFIX[prefix]
    raise AssertionError(f"{module}: not in the layer map of tests/test_layers.py; give its package a layer")


def imported_modules(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Project modules `module` imports anywhere in its body (resolved to the deepest existing module)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def test_every_module_has_a_layer():
    for module in all_modules():
        layer_of(module)


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for module, imports in sorted(import_graph().items()):
        mine = layer_of(module)
        for target in sorted(imports):
            theirs = layer_of(target)
            if mine is None:  # training may import anything
                continue
            if theirs is None:
                if mine < INTERFACES:
                    upward.append(f"{module} (layer {mine}) imports training code {target}")
            elif theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module are the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circles():
    circles = strongly_connected(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_checks_see_what_they_claim_to():
    # An honest check must catch what it forbids: a lazy upward import, training imported from the request path,
    # and a two-module circle.
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert strongly_connected(graph) == [["a", "b"]]
    assert layer_of("cortexstream.engine.runner") == 2 and layer_of("cortexstream.kv.arena") == 1
    assert layer_of("cortexstream.training.sidecar.train") is None
    sample = ROOT / "cortexstream" / "engine" / "runner.py"
    modules = all_modules()
    assert "cortexstream.engine.sequence" in imported_modules("cortexstream.engine.runner", sample, modules)
    lazy = ROOT / "cortexstream" / "__init__.py"  # imports only inside __getattr__
    assert "cortexstream.models.loader" in imported_modules("cortexstream", lazy, modules)

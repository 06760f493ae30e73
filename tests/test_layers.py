"""The house plan: each module imports only from its own layer or the layers below it, and no module is part of
an import circle. Read from the source (AST), so function-level ("lazy") imports and imports under
`TYPE_CHECKING` count too: a lazy import that goes up is still an upward dependency.

Layers, top to bottom:

    4  interfaces      cli, tui, server, benchmarks (and the repository's apps/ and bench/)
    3  public calls    `cortexstream` (load, generate, stream_generate, batch_generate, perplexity): generation/,
                       evaluation/
    2  engine          engine/ (scheduler, block manager, runner, policy runtime, sampling, prompts, text stream,
                       clients), c2c/ (fusion entered through a per-sequence hook) and distributed/ (ranks that
                       run rank 0's plans)
    1  KV, policies    kv/ (arena, allocator, caches) and policies/ (pure selection)
    0  foundation      models/, port/, kernels/, backend, grammar/, errors, atomic_files, the learned networks of
                       compression/ and sidecar/

Training (`cortexstream.training`) sits beside the product: it may import anything, and only interfaces (and
training itself) may import it, so nothing in the request path depends on training code.

Interfaces also reach an engine only through `EngineClient` and Engine's public methods: never its scheduler, block
manager, runner or private attributes (`test_interfaces_use_only_the_engines_public_surface`).
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
    "cortexstream.grammar": 0,
    "cortexstream.kv": 1,
    "cortexstream.policies": 1,
    "cortexstream.engine": 2,
    "cortexstream.c2c": 2,
    "cortexstream.distributed": 2,
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
    assert "cortexstream.engine.step_plan" in imported_modules("cortexstream.engine.runner", sample, modules)
    lazy = ROOT / "cortexstream" / "__init__.py"  # imports only inside __getattr__
    assert "cortexstream.models.loader" in imported_modules("cortexstream", lazy, modules)


# --- interfaces read the engine through EngineClient and Engine's public methods -----------------------------------
# Interfaces (server, TUI, CLI, benchmarks) see an engine through `EngineClient` (submit, stream, abort, stats,
# snapshot) and, inside `EngineClient.call`, through `Engine`'s public methods; never through its scheduler, block
# manager or runner, nor any private attribute of an engine.
# A folder that does not exist (yet, or any more) is simply empty.
BOUNDARY_DIRS = ("cortexstream/server", "cortexstream/cli", "cortexstream/benchmarks", "apps/tui", "bench")
ENGINE_PARTS = {"scheduler", "block_manager", "runner"}
# (file, attribute) -> why it must stay. Empty: every interface uses the public surface.
ENGINE_ACCESS_ALLOWED: dict[tuple[str, str], str] = {}


def _names_in(annotation: ast.expr) -> set[str]:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}


def _engine_names(tree: ast.AST) -> set[str]:
    """Names that hold an engine: parameters annotated Engine / ThreadedEngine, and the parameter of a lambda
    passed to `.call(...)` (EngineClient.call / ThreadedEngine.call hand it the engine)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs:
                if arg.annotation is not None and _names_in(arg.annotation) & {"Engine", "ThreadedEngine"}:
                    names.add(arg.arg)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call":
            if node.args and isinstance(node.args[0], ast.Lambda) and node.args[0].args.args:
                names.add(node.args[0].args.args[0].arg)
    return names


def _is_engine(node: ast.expr, names: set[str]) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return (isinstance(node, ast.Name) and name in names) or name in ("engine", "_engine", "threaded") or \
        name.endswith("_engine")


def engine_internals(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every access to an engine's parts (any receiver) or to a private attribute of an
    engine, by attribute or by getattr / hasattr / setattr / delattr with a literal name."""
    tree = ast.parse(source)
    names = _engine_names(tree)
    found = []
    for node in ast.walk(tree):
        attr, receiver = None, None
        if isinstance(node, ast.Attribute):
            attr, receiver = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attr, receiver = node.args[1].value, node.args[0]
        if attr is None:
            continue
        private = attr.startswith("_") and not attr.startswith("__")
        if attr in ENGINE_PARTS or (private and _is_engine(receiver, names)):
            found.append((node.lineno, attr))
    return sorted(found)


def test_interfaces_use_only_the_engines_public_surface():
    reached, allowed_used = [], set()
    for folder in BOUNDARY_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, attr in engine_internals(path.read_text(encoding="utf-8")):
                if (rel, attr) in ENGINE_ACCESS_ALLOWED:
                    allowed_used.add((rel, attr))
                else:
                    reached.append(f"{rel}:{line}: .{attr}")
    assert not reached, ("interfaces reaching into the engine (use EngineClient.snapshot / stats or Engine's "
                         "public methods):\n" + "\n".join(reached))
    assert allowed_used == set(ENGINE_ACCESS_ALLOWED), "allow-list entries no longer needed: remove them"


def test_the_engine_boundary_check_sees_what_it_claims_to():
    source = (
        "def f(engine, client, e2):\n"
        "    a = engine.scheduler.waiting\n"                              # 2: a part
        "    b = set(engine.block_manager._lru) if hasattr(engine.block_manager, '_lru') else set()\n"  # 3
        "    c = client.call(lambda e: e._states)\n"                      # 4: a private, through call
        "    d = self.bridge.engine._inflight\n"                          # 5
        "    g = getattr(engine, '_adaptive', None)\n"                    # 6
        "    ok = engine.snapshot(blocks=False).waiting, engine.stats(), e2._fine, self._mine\n"
        "def h(x: 'Engine'):\n"
        "    return x._eos_ids\n"                                          # 9
    )
    assert engine_internals(source) == [(2, "scheduler"), (3, "block_manager"), (3, "block_manager"),
                                        (4, "_states"), (5, "_inflight"), (6, "_adaptive"), (9, "_eos_ids")]

"""No module reads or writes another object's private attributes: a class that needs something from another class
calls a public method of it. Read from the source (AST) of every module of `cortexstream/`, `apps/` and `bench/`
(tests excepted, they may look inside what they test).

An access is private when its name has one leading underscore and is not a dunder (`x._states`, also
`getattr(x, "_states")` / `hasattr` / `setattr` / `delattr` with a literal name). It is fine when the receiver is
the object's own class:

* `self._x`, `cls._x`, `super()._x`, and `Name._x` inside class `Name`;
* `other._x` inside a method of class `C` where `other` is a parameter annotated `C` (`__eq__`, `merge(other: C)`):
  the same class's private, read by the class that defines it;
* a documented-public name that happens to start with an underscore (namedtuple's `_replace`, `_asdict`, ...).

Importing a module's private name (`from mlx_lm.utils import _get_classes`) or a private module is reach too.

Anything else fails, unless it is allowed with the reason it must stay: a library name in `LIBRARY_NAMES_ALLOWED`
(`os._exit`, documented; argparse's subparsers type, which has no public name), or one file's access in
`PRIVATE_ACCESS_ALLOWED` (a library's module-private API with no public equivalent). Entries no longer used fail
too, so the lists stay minimal.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cortexstream", "apps", "bench")

# Documented public API whose names begin with an underscore.
PUBLIC_UNDERSCORE_NAMES = {
    "_replace": "collections.namedtuple: a copy with some fields replaced (documented public API)",
    "_asdict": "collections.namedtuple: the fields as a dict (documented public API)",
    "_fields": "collections.namedtuple: the field names (documented public API)",
    "_make": "collections.namedtuple: build from an iterable (documented public API)",
    "_field_defaults": "collections.namedtuple: the fields' defaults (documented public API)",
}

# Library names that begin with an underscore, allowed anywhere (the access as written) -> why.
LIBRARY_NAMES_ALLOWED = {
    "os._exit": "documented: exit without the interpreter's teardown (the server's clean shutdown needs it)",
    "argparse._SubParsersAction": "the type of ArgumentParser.add_subparsers(), which argparse names no other "
                                  "way; used in type hints only",
}

# (file, the access as written, e.g. "mlx_lm.utils._get_classes") -> why it must stay.
PRIVATE_ACCESS_ALLOWED: dict[tuple[str, str], str] = {
}

RECEIVERS_OF_SELF = {"self", "cls"}
NAME_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} | \
        {n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


class _Finder(ast.NodeVisitor):
    """Collects (line, access) of every private access whose receiver is not the accessing class itself."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self._classes: list[str] = []  # enclosing classes, innermost last
        self._same_class: list[set[str]] = [set()]  # names that hold an instance of the enclosing class

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node.name)
        self._same_class.append(set())
        self.generic_visit(node)
        self._same_class.pop()
        self._classes.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        inherited = self._same_class[-1]
        mine = set(inherited)
        if self._classes and not isinstance(node, ast.Lambda):
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs:
                if self._classes[-1] in _annotation_names(arg.annotation):
                    mine.add(arg.arg)
        self._same_class.append(mine)
        self.generic_visit(node)
        self._same_class.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def _own(self, receiver: ast.expr) -> bool:
        if isinstance(receiver, ast.Name):
            return (receiver.id in RECEIVERS_OF_SELF or receiver.id in self._same_class[-1]
                    or receiver.id in self._classes)
        return (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
                and receiver.func.id == "super")

    def _check(self, node: ast.AST, receiver: ast.expr, attr: str) -> None:
        if _is_private(attr) and attr not in PUBLIC_UNDERSCORE_NAMES and not self._own(receiver):
            self.found.append((node.lineno, f"{ast.unparse(receiver)}.{attr}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "." * node.level + (node.module or "")
        for alias in node.names:
            if any(_is_private(part) for part in f"{node.module or ''}.{alias.name}".split(".") if part):
                self.found.append((node.lineno, f"{module}.{alias.name}" if node.module else module + alias.name))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if any(_is_private(part) for part in alias.name.split(".")):
                self.found.append((node.lineno, alias.name))

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in NAME_FUNCTIONS and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            self._check(node, node.args[0], node.args[1].value)
        self.generic_visit(node)


def private_reach(source: str) -> list[tuple[int, str]]:
    """(line, "receiver._name") of every read or write of another object's private attribute in `source`."""
    finder = _Finder()
    finder.visit(ast.parse(source))
    return sorted(finder.found)


def project_files() -> list[pathlib.Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_no_module_reads_another_objects_private_attributes():
    reached, allowed_used = [], set()
    for path in project_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, access in private_reach(path.read_text(encoding="utf-8")):
            if access in LIBRARY_NAMES_ALLOWED:
                allowed_used.add(access)
            elif (rel, access) in PRIVATE_ACCESS_ALLOWED:
                allowed_used.add((rel, access))
            else:
                reached.append(f"{rel}:{line}: {access}")
    assert not reached, ("private attributes read from outside their class (add a public method):\n"
                         + "\n".join(reached))
    unused = (set(PRIVATE_ACCESS_ALLOWED) | set(LIBRARY_NAMES_ALLOWED)) - allowed_used
    assert not unused, f"allow-list entries no longer needed: remove them: {sorted(map(str, unused))}"


def test_the_private_reach_check_sees_what_it_claims_to():
    source = (
        "import sys, mlx._impl\n"                                             # 1: a private module
        "from mlx_lm.utils import _get_classes, load\n"                      # 2: a module's private name
        "class Box:\n"
        "    def __init__(self, engine):\n"
        "        self._x = engine._states\n"                                   # 5: another object's private
        "        super()._setup(); Box._count = 1; self.__dict__\n"            # fine: own class, dunder
        "    def __eq__(self, other: 'Box'):\n"
        "        return self._x == other._x\n"                                 # fine: same class, annotated
        "    def merge(self, other):\n"
        "        return other._x\n"                                            # 10: unannotated: not known
        "    @classmethod\n"
        "    def make(cls, row):\n"
        "        return cls._build(row._replace(a=1)._asdict())\n"             # fine: own class, namedtuple
        "def f(box: Box, stream):\n"
        "    stream._queue.put(1)\n"                                           # 15: write through a read
        "    setattr(box, '_x', 2); getattr(box, 'x'); hasattr(box, '_y')\n"   # 16: setattr, hasattr
        "    box.engine._eos_ids = set()\n"                                    # 17: a write
        "    return sys._getframe(1), (lambda self: self._ok)\n"              # 18: module-private API
    )
    assert private_reach(source) == [
        (1, "mlx._impl"), (2, "mlx_lm.utils._get_classes"), (5, "engine._states"), (10, "other._x"),
        (15, "stream._queue"), (16, "box._x"), (16, "box._y"), (17, "box.engine._eos_ids"), (18, "sys._getframe")]

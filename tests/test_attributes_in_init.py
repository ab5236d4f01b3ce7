"""House rule: every attribute an object will ever have is set in its ``__init__`` (or declared on its class),
so a reader finds an object's whole state in one place and no method reads an attribute a path never set."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("metronome", "sim", "probe")
BUILDERS = ("__init__", "__post_init__", "__new__")


def _self_attrs(target):
    if isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            yield from _self_attrs(e)
    elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        yield target.attr


def _sets(fn):
    for n in ast.walk(fn):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for a in _self_attrs(t):
                yield a, n.lineno


def _declared(node, classes, seen=()):
    """Names the class (or a base class in the repository) declares: class-level names, methods and
    properties, and what its constructors set."""
    names = set()
    for b in node.body:
        if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
            names.add(b.target.id)
        elif isinstance(b, ast.Assign):
            for t in b.targets:
                names |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
        elif isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(b.name)
            if b.name in BUILDERS:
                names |= {a for a, _ in _sets(b)}
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        for other in classes.get(name, ()):
            if other is not node and other.name not in seen:
                names |= _declared(other, classes, seen + (node.name,))
    return names


def attributes_set_outside_init(files, root: Path = ROOT) -> list[str]:
    trees = {f: ast.parse(f.read_text()) for f in files}
    classes: dict[str, list] = {}
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, []).append(n)
    found = set()
    for f, tree in trees.items():
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            ok = _declared(node, classes)
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name not in BUILDERS:
                    found |= {f"{f.relative_to(root)}:{line}: {node.name}.{a} first set in {fn.name}()"
                              for a, line in _sets(fn) if a not in ok}
    return sorted(found)


def test_every_attribute_is_set_in_init():
    files = [f for d in FOLDERS for f in sorted((ROOT / d).rglob("*.py"))]
    assert attributes_set_outside_init(files) == []


def test_the_check_sees_an_attribute_first_set_in_a_method(tmp_path):
    f = tmp_path / "scratch.py"
    f.write_text("class Base:\n    def __init__(self):\n        self.a = 1\n\n"
                 "class C(Base):\n    b: int = 0\n    def start(self):\n        self.a, self.b = 2, 3\n"
                 "        self.c = 4\n")
    assert attributes_set_outside_init([f], tmp_path) == ["scratch.py:9: C.c first set in start()"]

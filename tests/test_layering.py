"""The package's floors point down: no import cycle between files, no import against the order
docs/architecture.md states.

Every import of src/segcache counts, read with `ast`: module level, inside functions, under
`if TYPE_CHECKING:` (an annotation-only import is still a dependency a reader must hold), relative
and absolute. `from . import x` is the file x.py (or the folder x/). Importing `a.b.c` also runs
the `__init__.py` of every package on the way that the importer is not inside, so those count too.
Names loaded by `importlib.import_module` (the lazy public names of `__init__.py`) are not read.

The order is the fenced block marked `floors` in docs/architecture.md: a line `N  entry entry ...`,
an entry a file (`runtime.py`) or a folder (`batch/`) under src/segcache/; a file belongs to the
longest entry that holds it (its room). A file may import files of its own room and of rooms on
lower floors only: not of another room on its own floor, never of a higher one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "segcache"
DOC = ROOT / "docs" / "architecture.md"

# (importing file, imported module) pairs tolerated while a change that removes them is under way
# (none now); an entry whose import is gone fails, so the list never outlives its reason.
PENDING: set = set()


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def imports(mods: dict[str, Path], pending: set | None = None) -> list[tuple[str, int, str]]:
    """Every (importing module, line, imported module) of the package but the PENDING ones (those
    met are added to `pending`)."""

    def known(name: str) -> str | None:  # the longest prefix of `name` that is a module of the package
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    def with_parents(importer: str, target: str) -> list[str]:
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first, except those the
        # importer is inside (its own packages are initialised before it runs)
        parts = target.split(".")
        chain = [".".join(parts[:i]) for i in range(1, len(parts))]
        own = importer if mods[importer].name == "__init__.py" else importer.rpartition(".")[0]
        return [p for p in chain if p in mods and not (own + ".").startswith(p + ".")] + [target]

    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.split(".")[0] == "segcache"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "segcache":
                    base = node.module
                else:
                    continue
                # `from pkg import x`: the module pkg.x if there is one, else a name of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base) for a in node.names]
            for target in dict.fromkeys(targets):
                assert target is not None, f"{rel(path)}:{node.lineno} imports a module segcache does not have"
                if (rel(path), target) in PENDING:
                    if pending is not None:
                        pending.add((rel(path), target))
                    continue
                out.extend((name, node.lineno, t) for t in with_parents(name, target) if t != name)
    return out


def floors() -> dict[str, int]:
    """Room (a file or folder under src/segcache, as the doc writes it) -> its floor."""
    blocks = re.findall(r"^```floors\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, f"{DOC.relative_to(ROOT)} needs exactly one ```floors block, found {len(blocks)}"
    out = {}
    for line in blocks[0].splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        floor, *rooms = line.split()
        assert floor.isdigit() and rooms, f"floors line {line!r}: want 'N  room room ...'"
        for room in rooms:
            assert room not in out, f"{room} stands on floors {out[room]} and {floor}"
            out[room] = int(floor)
    return out


def room_of(path: Path, order: dict[str, int]) -> str | None:
    name = rel(path)
    held = [r for r in order if r == name or (r.endswith("/") and name.startswith(r))]
    return max(held, key=len, default=None)


def components(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): the import cycles."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_files():
    mods = modules()
    edges: dict[str, dict[str, int]] = {}
    for a, line, b in imports(mods):
        edges.setdefault(a, {}).setdefault(b, line)
    found = components(edges)
    described = []
    for comp in found:
        inside = [f"{rel(mods[a])}:{line} -> {rel(mods[b])}" for a in comp for b, line in sorted(edges[a].items())
                  if b in comp]
        described.append(f"{len(comp)} files import each other: " + ", ".join(inside))
    assert not found, "import cycles (file:line of each import in the cycle):\n  " + "\n  ".join(described)


def test_every_file_stands_on_a_floor_of_the_documented_order():
    order = floors()
    lost = [rel(p) for p in modules().values() if room_of(p, order) is None]
    assert not lost, f"files on no floor of {DOC.relative_to(ROOT)}'s ```floors block: {lost}"


def test_imports_point_down_the_documented_floors():
    order, mods = floors(), modules()
    wrong = {}  # (file, line, room imported) -> the deepest module imported there
    for a, line, b in imports(mods):
        ra, rb = room_of(mods[a], order), room_of(mods[b], order)
        if ra is not None and rb is not None and ra != rb and order[rb] >= order[ra]:
            key = (rel(mods[a]), line, ra, rb)
            wrong[key] = max(wrong.get(key, ""), b, key=len)
    wrong = [f"{path}:{line} imports {b}: {ra} (floor {order[ra]}) -> {rb} (floor {order[rb]}, "
             + ("its own floor)" if order[rb] == order[ra] else "a higher floor)")
             for (path, line, ra, rb), b in sorted(wrong.items())]
    assert not wrong, (f"imports against the floors of {DOC.relative_to(ROOT)} "
                       f"(a room imports only rooms on lower floors):\n  " + "\n  ".join(wrong))


def test_the_reader_sees_every_kind_of_import():
    # the cases the checks above rely on, on the package itself: a function-level import
    # (cli.py's subcommands), a TYPE_CHECKING one, `from . import x` as a file
    mods = modules()
    seen = {(a, b) for a, _, b in imports(mods)}
    assert ("segcache.cli", "segcache.cli_generate") in seen  # `from . import cli_generate` in a function
    assert ("segcache.serve.shapes", "segcache.serve.pipeline") in seen  # under TYPE_CHECKING
    assert ("segcache.batch.runtime", "segcache.registry") in seen  # `from ..registry import`


def test_pending_imports_are_still_there():
    # an entry of PENDING whose import is gone would hide the next such import: delete it
    met: set = set()
    imports(modules(), met)
    assert met == PENDING, f"PENDING entries whose import is gone (delete them): {sorted(PENDING - met)}"

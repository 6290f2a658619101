"""Tier-1: imports point down (docs/architecture.md, "Layers and imports").

Layers, lowest first: ``mtcfs/base`` < ``mtcfs/core`` < ``mtcfs/tiers`` < top (the modules
directly in ``mtcfs/``: cli, daemon, fuse_ops, control, options, metrics, __main__). A
module may import from its own layer and the layers below, with two more rules:

* a tier imports nothing of the core but :mod:`mtcfs.core.ports` (which re-exports the
  core types that cross the boundary);
* no module imports a private name (``_x``: a module, a package or a member) of a package
  it is not part of.

Every import counts, those inside functions and under ``if TYPE_CHECKING`` included. The
check reads the source with :mod:`ast`; nothing is imported or mounted.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = {"base": 0, "core": 1, "tiers": 2}
TOP = 3
NAMES = {0: "base", 1: "core", 2: "tiers", 3: "top"}
#: The one module of the core that the tiers may import.
CORE_PORT = "mtcfs.core.ports"


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    target: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: imports {self.target}: {self.why}"


def layer_of(module: str) -> int | None:
    """The layer of a module of the package (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "mtcfs":
        return None
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    return TOP


class Tree:
    """The modules under ``src/mtcfs``, by dotted name."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.modules: dict[str, Path] = {}
        self.packages: set[str] = set()
        for path in sorted((src / "mtcfs").rglob("*.py")):
            rel = path.relative_to(src).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
                self.packages.add(".".join(parts))
            self.modules[".".join(parts)] = path

    def is_module(self, name: str) -> bool:
        return name in self.modules

    def package_of(self, module: str) -> str:
        return module if module in self.packages else module.rpartition(".")[0]


def _imports(tree: Tree, module: str) -> list[tuple[int, str, str | None]]:
    """(line, module imported, member imported or None) for each import of ``module``."""
    node = ast.parse(tree.modules[module].read_text(), str(tree.modules[module]))
    here = tree.package_of(module)
    out: list[tuple[int, str, str | None]] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out.extend((n.lineno, a.name, None) for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = here.split(".")
                anchor = anchor[:len(anchor) - (n.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in n.names:
                full = f"{base}.{a.name}"
                if tree.is_module(full):
                    out.append((n.lineno, full, None))
                else:
                    out.append((n.lineno, base, a.name))
    return out


def _private_scope(tree: Tree, parts: list[str]) -> str | None:
    """Where the first private component of ``parts`` may be imported from: the package
    that defines it (None: nothing private)."""
    for i, part in enumerate(parts):
        if i == 0 or not part.startswith("_") or (part.startswith("__") and part.endswith("__")):
            continue
        owner = ".".join(parts[:i])
        return tree.package_of(owner)
    return None


def violations(src: Path) -> list[Violation]:
    """Every import under ``src/mtcfs`` that breaks the layer rules."""
    tree = Tree(src)
    found: list[Violation] = []
    for module in tree.modules:
        mine = layer_of(module)
        assert mine is not None
        for line, target, member in _imports(tree, module):
            theirs = layer_of(target)
            if theirs is None:
                continue
            shown = target + (f".{member}" if member else "")
            if theirs > mine:
                found.append(Violation(module, line, shown,
                                       f"{NAMES[mine]} may not import {NAMES[theirs]}"))
            elif mine == LAYERS["tiers"] and theirs == LAYERS["core"] and \
                    target != CORE_PORT and not (target == "mtcfs.core" and member == "ports"):
                found.append(Violation(module, line, shown,
                                       f"a tier sees the core only through {CORE_PORT}"))
            parts = target.split(".") + ([member] if member else [])
            scope = _private_scope(tree, parts)
            if scope is not None and module != scope and not module.startswith(scope + "."):
                found.append(Violation(module, line, shown,
                                       f"a private name of {scope}, imported from outside it"))
    return found


def test_imports_point_down() -> None:
    found = violations(ROOT)
    assert not found, "imports against the layer rules:\n" + "\n".join(map(str, found))


def test_the_check_finds_bad_imports(tmp_path: Path) -> None:
    """The checker itself, on a small tree with one import of each kind."""
    files = {
        "mtcfs/__init__.py": "",
        "mtcfs/daemon.py": "from mtcfs.core.core import Filesystem\n",
        "mtcfs/base/__init__.py": "",
        "mtcfs/base/steps.py": "import mtcfs.tiers.peer\n",                  # base -> tiers
        "mtcfs/core/__init__.py": "",
        "mtcfs/core/core.py": "from mtcfs.daemon import main\n",              # core -> top
        "mtcfs/core/ports.py": "from mtcfs.core.core import Filesystem\n",
        "mtcfs/tiers/__init__.py": "",
        "mtcfs/tiers/peer/__init__.py": "",
        "mtcfs/tiers/peer/_pb.py": "",
        "mtcfs/tiers/peer/tier.py": (
            "from mtcfs.core.ports import Version\n"                         # allowed
            "from mtcfs.core import ports\n"                                 # allowed
            "from mtcfs.tiers.peer import _pb\n"                             # its own: allowed
            "from ..peer._pb import x\n"                                     # its own: allowed
            "def f():\n    from mtcfs.core.core import Filesystem\n"),       # core, not ports
        "mtcfs/tiers/mtc/__init__.py": "",
        "mtcfs/tiers/mtc/replicator.py": (
            "from mtcfs.tiers.peer.tier import _helper\n"                    # private member
            "from mtcfs.tiers.peer._pb import x\n"                           # private module
            "from mtcfs.tiers.peer.tier import PeerTier\n"                   # allowed
            "from mtcfs.options import MAX_NODES\n"),                        # tiers -> top
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    got = sorted((v.module, v.line) for v in violations(tmp_path))
    assert got == [
        ("mtcfs.base.steps", 1),
        ("mtcfs.core.core", 1),
        ("mtcfs.tiers.mtc.replicator", 1),
        ("mtcfs.tiers.mtc.replicator", 2),
        ("mtcfs.tiers.mtc.replicator", 4),
        ("mtcfs.tiers.peer.tier", 6),
    ], got

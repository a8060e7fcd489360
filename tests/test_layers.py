"""The layers point one way: every import of every module in server/ (lazy ones inside functions
and TYPE_CHECKING ones included) follows the table of allowed package edges, and no two modules
import each other, directly or round a circle (docs/architecture.md, "Layers").

The order, top to bottom: the composition roots (server/cli.py, server/serve.py, server/llm.py, server/chat_reading.py
and the package's lazy `server/__init__.py`), then
    api → gateway → serving → engine → text → models → kernels → server._C
with server/jsonfile.py, server/strenum.py, server/heap.py, server/hugepages.py and server/inference_mode.py leaves
anyone may read. An edge may skip
layers downwards only where the table says so; nothing imports upwards, and no layer imports a root.
"""
from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "server"

ROOTS = {"server", "server.cli", "server.serve", "server.llm", "server.chat_reading"}
LEAVES = {"server.jsonfile", "server.strenum", "server.heap", "server.hugepages", "server.inference_mode", "server._C"}

# package -> the packages (and leaves) its modules may import, besides its own modules.
ALLOWED: dict[str, set[str]] = {
    # The edge: the gateway's policy, the service, and the engine's torch-free types (outputs,
    # sampling_params; test_edge_units checks the edge loads no torch).
    "api": {"gateway", "serving", "engine", "text", "server.heap"},
    # Keys, auth, quotas and usage: over the service's types and the ledger.
    "gateway": {"serving"},
    # The request path: the engine (through the bridge; its torch-free types elsewhere), prompts
    # through text, models.generation_defaults (a model's suggested sampling values), and
    # models.pooling / models.registry (an embedding model's recipe and width, torch-free).
    "serving": {"engine", "text", "models", "server.strenum", "server.heap"},
    "engine": {"text", "models", "kernels", "server._C", "server.strenum", "server.heap", "server.hugepages",
               "server.inference_mode"},
    # The tokenizer reads GGUF files with models.gguf_file (and its error type, models.config).
    "text": {"models", "server.jsonfile"},
    "models": {"kernels", "server.jsonfile", "server.heap", "server.inference_mode"},
    "kernels": {"server._C", "server.strenum"},
}

# File-level circles still allowed, each with the issue that removes it.
ALLOWED_CIRCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in sorted(SERVER.rglob("*.py")):
        parts = path.relative_to(SERVER.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()
KNOWN = set(MODULES) | {"server._C"}


def _resolve(name: str) -> str:
    """The module (in server/) an imported name lives in: the longest known prefix."""
    while name not in KNOWN and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str) -> set[str]:
    """Every server module `module` imports, wherever the import statement is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from server.kernels import ops` imports the submodule; `from x import Name` imports x.
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in KNOWN]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(target)
    return {_resolve(n) for n in found if n == "server" or n.startswith("server.")} - {module}


GRAPH = {m: imports_of(m) for m in MODULES}


def layer_of(module: str) -> str:
    if module in ROOTS or module in LEAVES:
        return module
    return module.split(".")[1]


def test_every_import_follows_the_table_of_package_edges() -> None:
    offenders = []
    for module, targets in sorted(GRAPH.items()):
        src = layer_of(module)
        for target in sorted(targets):
            dst = layer_of(target)
            if dst == src or src in ROOTS:
                continue
            if src in LEAVES or dst in ROOTS or dst not in ALLOWED.get(src, set()):
                offenders.append(f"{module} -> {target}  ({src} -> {dst})")
    assert offenders == []


def test_the_table_is_one_way() -> None:
    # No pair of packages may import each other, even through a third (the table is a DAG).
    def reaches(a: str, b: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in ALLOWED.get(a, ()))

    assert [p for p in ALLOWED if reaches(p, p)] == []


def _circles() -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_round_a_circle() -> None:
    assert [sorted(c) for c in _circles() if c not in ALLOWED_CIRCLES] == []


def test_the_scan_sees_lazy_imports() -> None:
    # A guard on the scanner itself: these edges are written inside functions or TYPE_CHECKING.
    assert "server.engine.thread" in GRAPH["server.serving.bridge"]  # lazy, in EngineBridge.start
    assert "server.models.decoder" in GRAPH["server.models"]  # TYPE_CHECKING and __getattr__

"""The package's shape, read from its imports: no import circles, layers that only look down, the app's
interface (llama_core/app/ui.py) as interface only, gradio only in llama_core.app, and no module reaching
into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llama_core"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, at any depth (lazy ones too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from .serving import engine` imports the module serving.engine
                full = f"{base}.{alias.name}"
                found.append((full, []) if _is_module(full) else (base, [alias.name]))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)] = {m for m, _ in _imports(path) if m.startswith("llama_core")}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph.get(todo.pop(), ()):
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def test_the_package_has_no_import_circles():
    graph = _graph()
    circles = sorted(m for m in graph if m in _reachable(graph, m) and not m.endswith("__init__") and m != "llama_core")
    packages = {"llama_core", "llama_core.serving", "llama_core.distributed"}
    assert [m for m in circles if m not in packages] == []


@pytest.mark.parametrize("module", ["llama_core.serving.engine", "llama_core.serving.engine_process",
                                    "llama_core.serving.streams", "llama_core.serving.requests",
                                    "llama_core.serving.launch", "llama_core.loader", "llama_core.runner",
                                    "llama_core.distributed.device_map", "llama_core.distributed.parallel"])
def test_lower_layers_never_depend_on_the_facade(module):
    reached = _reachable(_graph(), module)
    assert "llama_core.generation" not in reached and "llama_core" not in reached


@pytest.mark.parametrize("module", ["llama_core.distributed.device_map", "llama_core.distributed.parallel",
                                    "llama_core.runner", "llama_core.model", "llama_core.checkpoint"])
def test_the_model_side_never_depends_on_serving(module):
    assert not any(m.startswith("llama_core.serving") for m in _reachable(_graph(), module))


UI = PACKAGE / "app" / "ui.py"


def test_the_app_interface_is_interface_only():
    imported = {m for m, _ in _imports(UI)}
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
    private = [(m, n) for m, names in _imports(UI) for n in names if n.startswith("_")]
    assert private == []
    # No checks of its own: every value is judged by llama_core.serving.requests.
    source = UI.read_text()
    assert "isinstance(" not in source


def test_only_the_app_imports_gradio():
    """gradio is the [app] extra: the rest of llama_core imports without it."""
    importers = sorted(_module_name(path) for path in PACKAGE.rglob("*.py")
                       if any(m.split(".")[0] in ("gradio", "gradio_client") for m, _ in _imports(path)))
    assert importers and all(m.startswith("llama_core.app.") for m in importers), importers
    graph = _graph()
    outside = [m for m in graph if not m.startswith("llama_core.app")]
    assert not [m for m in outside if any(d.startswith("llama_core.app") for d in graph[m])]


def test_the_root_app_py_only_starts_the_command_line():
    assert _imports(ROOT / "app.py") == [("sys", []), ("llama_core.app.cli", ["main"])]


def test_no_module_takes_private_names_from_another():
    taken = [
        (_module_name(path), module, name)
        for path in [*PACKAGE.rglob("*.py"), ROOT / "app.py", *(ROOT / "scripts").glob("*.py")]
        for module, names in _imports(path)
        if module.startswith("llama_core")
        for name in names
        if name.startswith("_") and name != "__version__"
    ]
    assert taken == []


def test_the_package_root_exports_the_public_api():
    import llama_core

    for name in ("Llama", "Engine", "EngineProcess", "LoadedModel", "ModelRunner", "GenerationRequest",
                 "TokenStream", "TextStream", "StreamChunk", "stream_chat", "stream_completion", "load"):
        assert name in llama_core.__all__ and getattr(llama_core, name) is not None

"""The shape of the code base, checked statically: no import circle among align's modules (counting imports
inside functions too), pipelines and the CLI know stages only through the registry, and a stage file stays a
sequence of short functions."""

import ast
from pathlib import Path

from tests.conftest import ROOT


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (top level or inside a function)."""
    found = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from align import runtime` imports align.runtime
    return found


def graph(package: str) -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    return {m: {i for i in imports(p) if i in files and i != m} for m, p in files.items()}


def test_no_import_circle_among_align_modules():
    g = graph("align")
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join(path[path.index(n):] + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_align_never_imports_a_stage_module():
    """align/ (the CLI and pipelines included) reaches stages only through align.registry, by name."""
    for p in (ROOT / "align").rglob("*.py"):
        assert not [i for i in imports(p) if i == "stages" or i.startswith("stages.")], p


def test_stage_functions_are_short():
    for p in (ROOT / "stages").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 80, f"{p.name}:{node.lineno} {node.name}"


def test_no_stage_imports_another_stage():
    """A stage owns its knowledge and shares only through align/: stages/X.py imports no stages.Y."""
    for p in (ROOT / "stages").glob("*.py"):
        own = module_name(p)
        assert not [i for i in imports(p) if i.startswith("stages.") and not i.startswith(own)], p


def test_each_algorithms_loss_is_one_function_of_align_objectives_named_in_the_engine_docs():
    """docs/engine.md's table "The losses" names each stage's loss and its module; each is a function there, the
    stage calls it, and the old homes of the math (align/rl.py, align/losses.py) stay gone."""
    import importlib
    import re

    doc = (ROOT / "docs" / "engine.md").read_text()
    table = doc[doc.index("## The losses"):doc.index("## Adding an objective")]
    rows = re.findall(r"^\| `align (\w+)[^|]*\| (`[^|]+`) \| `(\w+)\.py` \|", table, re.M)
    assert {stage for stage, _, _ in rows} >= {"sft", "rm", "dpo", "ppo", "grpo"}
    for stage, names, module in rows:
        mod = importlib.import_module(f"align.objectives.{module}")
        for name in re.findall(r"`(\w+)`", names):
            assert callable(getattr(mod, name, None)), f"{name} is not a function of align.objectives.{module}"
            assert re.search(rf"\b{name}\(", (ROOT / "stages" / f"{stage}.py").read_text()), f"stages/{stage}.py never calls {name}"
    assert not (ROOT / "align" / "rl.py").exists() and not (ROOT / "align" / "losses.py").exists()

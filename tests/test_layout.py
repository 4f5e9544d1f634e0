"""The crates' modules import one another without a circle: each crate's
top-level modules (a file, or a directory's mod.rs and what it holds) form
a graph with no cycle, so that each can be read, and changed, after the
ones it uses."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRATES = ["src", "core/src", "sidecar/src"]


def module_of(path, root):
    """The top-level module a file belongs to; `None` for the crate root."""
    parts = path.relative_to(root).with_suffix("").parts
    return None if parts in (("lib",), ("main",)) else parts[0]


def named_modules(text):
    """The top-level modules `crate::` paths in `text` name, in a group
    (`crate::{a::{x, y}, b}`) too."""
    named = set()
    for match in re.finditer(r"\bcrate::", text):
        rest = text[match.end():]
        if not rest.startswith("{"):
            named.update(re.findall(r"^\w+", rest))
            continue
        depth, item = 0, ""
        for char in rest:
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0 or depth == 1 and char == ",":
                named.update(re.findall(r"^[\s{]*(\w+)", item))
                item = ""
                if depth == 0:
                    break
            else:
                item += char
    return named


def imports(root):
    """{module: the other top-level modules of the crate it names}, tests
    (a `mod tests` block, or a file of its own) left out."""
    graph = {}
    for path in sorted(root.rglob("*.rs")):
        module = module_of(path, root)
        if module is None:
            continue
        graph.setdefault(module, set())
        if path.stem == "tests" or "tests" in path.relative_to(root).parts[:-1]:
            continue
        text = re.split(r"#\[cfg\(test\)\]\s*mod tests", path.read_text())[0]
        graph[module].update(named_modules(text) - {module})
    return {m: {n for n in named if n in graph} for m, named in graph.items()}


def circles(graph):
    """The strongly connected components of more than one module."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_a_path_names_is_found():
    assert named_modules("use crate::{a::{x, y}, b};\nlet c = crate::c::f();") == {"a", "b", "c"}


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("crate", CRATES)
def test_no_module_imports_one_that_imports_it(crate):
    graph = imports(ROOT / crate)
    assert len(graph) > 3
    assert circles(graph) == []

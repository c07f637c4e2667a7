"""The package's structure: every import of a vkattn module (at the top of a file or inside a
function) goes to the same layer or a lower one, no two modules import each other in a circle, and
imports inside functions are only the ones listed below, each with its reason. perf/ too: its
modules import vkattn's, never the other way round, and no circle among them."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a module may import modules of its own layer or below
LAYERS = [
    {"errors", "_version", "checks", "reference", "formats", "spirv", "_driverfix", "_vkinfo", "_files"},
    {"compiler", "tuning"},
    {"_kp"},
    {"device"},                         # limits, features, verdicts: builds no cache
    {"array", "_attn", "paging", "graph"},   # device arrays, plans and pipelines, block bookkeeping,
                                             # recorded submissions (caches hand them their calls)
    {"_base"},
    {"persist", "cascade"},
    {"cache", "paged"},
    {"measure"},                        # builds caches to measure a device, records on it
    {"__init__"},
    {"check", "hf", "__main__", "tools", "tools.vkpipeline", "tools.spirv_audit"},
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}

# imports inside functions, (file, imported module): each keeps something out of `import vkattn`
LOCAL_OK = {
    ("vkattn/__main__.py", "torch"): "optional: the hf extra (generate only)",
    ("vkattn/__main__.py", "transformers"): "optional: the hf extra",
    ("vkattn/__main__.py", "hf"): "vkattn.hf imports torch and transformers",
    ("vkattn/persist.py", "safetensors"): "only save and load need it; its ImportError names the fix",
    ("vkattn/persist.py", "safetensors.numpy"): "as above",
    ("vkattn/tools/vkpipeline.py", "types"): "run as a file: the bare-package set-up before any import",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "vkattn").with_suffix("")
    return ".".join(rel.parts)


def _vkattn_imports(path: Path):
    """(line, imported vkattn module or None, full name, inside a function) of every import."""
    tree = ast.parse(path.read_text())
    pkg = _module_name(path).split(".")[:-1]          # the importing file's package, below vkattn
    out = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    name = a.name
                    mod = name[len("vkattn."):] if name.startswith("vkattn.") else None
                    out.append((child.lineno, mod, name, local))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg[:len(pkg) - (child.level - 1)] if child.level > 1 else pkg
                    if child.module:
                        names = [".".join(base + [child.module])]
                    else:               # `from . import x`: a submodule x, or a name of the package
                        names = [".".join(base + [a.name]) if _is_module(base + [a.name]) else
                                 (".".join(base) or "__init__") for a in child.names]
                    for m in names:
                        out.append((child.lineno, m, m, local))
                else:
                    mod = child.module or ""
                    out.append((child.lineno, mod[len("vkattn."):] if mod.startswith("vkattn.") else
                                ("__init__" if mod == "vkattn" else None), mod, local))
            visit(child, inner)
    visit(tree, False)
    return out


def _is_module(parts) -> bool:
    p = ROOT.joinpath("vkattn", *parts)
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _files():
    return sorted(p for p in (ROOT / "vkattn").rglob("*.py") if "shaders" not in p.parts)


def _layer_of(mod: str):
    if mod in LAYER:
        return LAYER[mod]
    head = mod.split(".")[0]
    if head == "tools":
        return LAYER["tools"]
    return LAYER.get(head)


def test_every_module_has_a_layer():
    missing = [_module_name(p) for p in _files() if _layer_of(_module_name(p)) is None]
    assert not missing, f"modules with no layer in tests/test_layers.py: {missing}"


def test_imports_go_down():
    upward, local = [], []
    for path in _files():
        me = _module_name(path)
        rel = str(path.relative_to(ROOT))
        for line, mod, full, inside in _vkattn_imports(path):
            if inside and (rel, full) not in LOCAL_OK and (rel, mod) not in LOCAL_OK:
                local.append(f"{rel}:{line} imports {full} inside a function")
            if mod is None:
                continue
            if mod == "__init__" and me != "__init__" and _layer_of(me) <= LAYER["__init__"]:
                upward.append(f"{rel}:{line} imports the package (vkattn/__init__.py) from below it")
                continue
            lm, li = _layer_of(me), _layer_of(mod)
            if li is not None and lm is not None and li > lm:
                upward.append(f"{rel}:{line} ({me}, layer {lm}) imports {mod} (layer {li})")
    assert not upward, "\n".join(upward)
    assert not local, "\n".join(local)


def _graph(files, name_of, resolve):
    graph = {}
    for path in files:
        me = name_of(path)
        graph[me] = {m for _, m, _, _ in resolve(path) if m and m != me}
    return graph


def _circles(graph) -> list:
    found, state = [], {}

    def dfs(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif not state.get(nxt):
                dfs(nxt, stack)
        stack.pop()
        state[node] = 2
    for n in sorted(graph):
        if not state.get(n):
            dfs(n, [])
    return found


def test_no_circles_in_vkattn():
    graph = _graph(_files(), _module_name, _vkattn_imports)
    graph.pop("__init__", None)      # the package imports everything it exports
    for deps in graph.values():
        deps.discard("__init__")
    assert not _circles(graph)


def test_no_circles_in_perf():
    files = sorted((ROOT / "perf").glob("*.py"))

    def resolve(path):
        out = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                mods = [node.module] if node.module else [a.name for a in node.names]
                out += [(node.lineno, m, m, False) for m in mods]
        return out
    graph = _graph(files, lambda p: p.stem, resolve)
    graph.pop("__main__", None)
    assert not _circles(graph)
    # vkattn never imports perf, nor the examples (examples/llama_device imports vkattn)
    for path in _files():
        text = path.read_text()
        assert "import perf" not in text and "from perf" not in text, path
        assert "import examples" not in text and "from examples" not in text, path


def test_the_checker_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert not _circles({"a": {"b"}, "b": {"c"}, "c": set()})

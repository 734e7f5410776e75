"""Folders by process (issue #34): imports go down the layers, never up, and no module imports itself in a circle.

Layers, top to bottom (``LAYERS``), one per folder of ``verl_backend`` (issue #46 item 1); a module may import its
own layer and the layers below it:

1. ``driver``: ``verl_backend/driver/`` (and ``aot/``, in the same layer for now), only in the ``verl train`` process;
2. ``workers``: ``verl_backend/workers/``: the plugin, the platforms, the engine, checkpoints, slice pools, SIGTERM;
3. ``rollout``: ``verl_backend/rollout/``: the native rollout (server, replica, adapter);
4. ``weight_sync``: ``verl_backend/weight_sync/``: the transports; it depends on the rollout only through the
   rollout's interface on the floor below (``verl_backend/worker_sampler.py``) and values its callers pass;
5. ``host_memory``: ``verl_backend/host_memory/``: heap, fork server, the unwrapped CPU rank;
6. ``patches``: ``verl_backend/patches/``: the touch points of VeRL, TransferQueue and FSDP2; the rl-tpu features two
   patches run are handed down by the plugin (``verl_backend.patches.apply(features=...)``);
7. ``data``: ``verl_backend/data/``: converters to VeRL's parquet and reward functions;
8. ``shared``: the modules at ``verl_backend/``'s root (settings, errors, the default model, the worker sampler's
   interface), read by the driver and the workers alike;
9. ``ray_cluster``: the ``rl-tpu`` command and the slice placement the layers above call; it imports only ``rl_tpu``;
10. ``rl_tpu``: device and slice facts, the sampler; it imports none of the others.

``edge_export`` (the ``litert`` command) stands apart (``APART``): it may import ``rl_tpu`` and nothing else of the
others, and none of them imports it (``verl train --export`` runs it as a subprocess).

What counts as an import: every ``import`` and ``from ... import`` in a module's source, at module level or inside a
function, a class or an ``if TYPE_CHECKING:`` block, absolute or relative. ``from pkg import name`` is an import of
``pkg.name`` when that is a module, else of ``pkg``. The import of a parent package that Python runs first is not
counted (a package's ``__init__`` that imports its own modules would otherwise always close a circle).
A circle is a strongly connected set of two or more modules in that graph.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("verl_backend", "rl_tpu", "ray_cluster", "edge_export")

# top to bottom; a folder (package) of the repository → its layer. A folder missing here is an error: give it a
# layer and a row in the README's layout table.
LAYERS = (
    "driver",
    "workers",
    "rollout",
    "weight_sync",
    "host_memory",
    "patches",
    "data",
    "shared",
    "ray_cluster",
    "rl_tpu",
)
FOLDERS = {
    "verl_backend.driver": "driver",
    "verl_backend.driver.aot": "driver",  # the aot circle with the driver is issue #46's other part
    "verl_backend.workers": "workers",
    "verl_backend.rollout": "rollout",
    "verl_backend.weight_sync": "weight_sync",
    "verl_backend.host_memory": "host_memory",
    "verl_backend.patches": "patches",
    "verl_backend.data": "data",
    "verl_backend": "shared",
    "ray_cluster": "ray_cluster",
    "rl_tpu": "rl_tpu",
    "rl_tpu.sampler": "rl_tpu",
    "rl_tpu.patches": "rl_tpu",  # the touch-point records' own folder (issue #34 item 3), where it exists
    "edge_export": "edge_export",
}
APART = {"edge_export": {"rl_tpu"}}  # a layer beside the others: the layers it may import; none may import it


def find_modules(root: Path, packages) -> dict[str, tuple[Path, bool]]:
    """Every module of ``packages`` under ``root``: dotted name → (file, is a package ``__init__``)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(root: Path, packages) -> dict[str, set[str]]:
    """Module → the modules of ``packages`` it imports (see the module docstring for what counts)."""
    modules = find_modules(root, packages)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                targets.update(known(f"{source}.{alias.name}") for alias in node.names)
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets
    return graph


def folder_of(module: str, root: Path) -> str:
    """The folder (package) a module is in; a package's ``__init__`` is in its own folder."""
    is_package = (root / module.replace(".", "/") / "__init__.py").exists()
    return module if is_package else module.rpartition(".")[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
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
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def problems(root: Path, packages, folders: dict[str, str], layers, apart) -> list[str]:
    """One line per folder without a layer, per import that goes up a layer, into a layer apart or out of one to a
    layer it may not import, and per circle."""
    graph = import_graph(root, packages)
    out = []
    layer = {}
    for module in graph:
        folder = folder_of(module, root)
        if folder not in folders:
            out.append(f"folder {folder} has no layer (add it to FOLDERS and to the README's layout table)")
            continue
        layer[module] = folders[folder]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = layer.get(module), layer.get(target)
            if here is None or there is None or here == there:
                continue
            if there in apart:
                out.append(f"{module} imports {target}: into '{there}', which stands apart")
            elif here in apart:
                if there not in apart[here]:
                    out.append(f"{module} imports {target}: out of '{here}', which stands apart, to '{there}'")
            elif layers.index(there) < layers.index(here):
                out.append(f"{module} imports {target}: up from '{here}' to '{there}'")
    out += ["import circle: " + " ↔ ".join(members) for members in circles(graph)]
    return out


# ------------------------------------------------------------------------------------------------- the repository
def test_imports_go_down_the_layers_and_make_no_circle():
    assert problems(ROOT, PACKAGES, FOLDERS, LAYERS, APART) == []


def test_the_graph_is_the_real_one():
    """Guards the test above against passing on an empty graph: known arrows of each kind are found."""
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 100
    assert "verl_backend.driver.runner" in graph["verl_backend.driver.train"]  # module level
    assert "verl_backend.workers.preemption" in graph["verl_backend.workers.plugin"]  # inside a function
    assert "verl_backend.weight_sync.base" in graph["verl_backend.weight_sync.route"]
    assert "ray_cluster.fake_slice" in graph["ray_cluster.cli"]  # relative, inside a function: `from . import ...`
    assert "ray_cluster.errors" in graph["ray_cluster.jobs"]  # relative: `from .errors import ...`
    assert "ray_cluster.placement" in graph["verl_backend.workers.slice_pool"]


def test_every_folder_is_in_the_readme_layout_table():
    """The README's layout table says which process runs each folder: each folder of ``FOLDERS`` is named in a row's
    first cell, or a folder above it of the same layer is (``verl_backend/driver/`` covers ``driver/aot/``)."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Layout", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {path[:-1].replace("/", ".") for row in rows for path in re.findall(r"`([a-z_/]+/)`", row.split("|")[1])}
    assert len(rows) >= 8

    def covered(folder: str) -> bool:
        above = folder
        while above:
            if above in named and FOLDERS.get(above) == FOLDERS[folder]:
                return True
            above = above.rpartition(".")[0]
        return False

    assert [folder for folder in FOLDERS if not covered(folder)] == []


# ------------------------------------------------------------------------------------------ negative controls
def _fake_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


FAKE_FOLDERS = {"fake.high": "high", "fake.low": "low", "fake": "low", "fake.apart": "apart"}
FAKE_LAYERS = ("high", "low")
GOOD = {
    "fake/__init__.py": "",
    "fake/high/__init__.py": "",
    "fake/high/top.py": "from fake.low import base\nfrom ..low.base import helper\n",
    "fake/low/__init__.py": "from . import base\n",  # a package importing its own module: no circle
    "fake/low/base.py": "import os\n\ndef helper():\n    return os.sep\n",
    "fake/low/other.py": "from fake.low.base import helper\n",
    "fake/apart/__init__.py": "import json\n\nfrom fake.low import base\n",  # apart, importing what it may
}


def test_a_clean_fixture_has_no_problem(tmp_path):
    _fake_tree(tmp_path, GOOD)
    assert problems(tmp_path, ["fake"], FAKE_FOLDERS, FAKE_LAYERS, {"apart": {"low"}}) == []
    assert import_graph(tmp_path, ["fake"])["fake.high.top"] == {"fake.low.base"}


def test_an_upward_import_inside_a_function_is_reported(tmp_path):
    _fake_tree(tmp_path, {**GOOD, "fake/low/base.py": "def helper():\n    from fake.high import top\n    return top\n"})
    assert problems(tmp_path, ["fake"], FAKE_FOLDERS, FAKE_LAYERS, {"apart": {"low"}}) == [
        "fake.low.base imports fake.high.top: up from 'low' to 'high'",
        # top imports base and base imports top: also a circle
        "import circle: fake.high.top ↔ fake.low.base",
    ]


def test_an_upward_import_without_a_circle_is_reported(tmp_path):
    _fake_tree(tmp_path, {**GOOD, "fake/high/side.py": "", "fake/low/other.py": "import fake.high.side\n"})
    assert problems(tmp_path, ["fake"], FAKE_FOLDERS, FAKE_LAYERS, {"apart": {"low"}}) == [
        "fake.low.other imports fake.high.side: up from 'low' to 'high'"
    ]


def test_a_circle_within_one_layer_is_reported(tmp_path):
    _fake_tree(tmp_path, {**GOOD, "fake/low/base.py": "from . import other\n"})
    assert problems(tmp_path, ["fake"], FAKE_FOLDERS, FAKE_LAYERS, {"apart": {"low"}}) == [
        "import circle: fake.low.base ↔ fake.low.other"
    ]


def test_imports_into_and_out_of_the_layer_apart_and_a_folder_without_a_layer_are_reported(tmp_path):
    _fake_tree(
        tmp_path,
        {
            **GOOD,
            "fake/low/other.py": "from fake.apart import *\n",
            "fake/new/__init__.py": "",
            "fake/apart/__init__.py": "from fake.high import top\n",
        },
    )
    assert problems(tmp_path, ["fake"], FAKE_FOLDERS, FAKE_LAYERS, {"apart": {"low"}}) == [
        "folder fake.new has no layer (add it to FOLDERS and to the README's layout table)",
        "fake.apart imports fake.high.top: out of 'apart', which stands apart, to 'high'",
        "fake.low.other imports fake.apart: into 'apart', which stands apart",
    ]


@pytest.mark.parametrize(
    "module, target, folders",
    [
        ("verl_backend.weight_sync.gloo_engine", "verl_backend.rollout.inworker", ("weight_sync", "rollout")),
        ("verl_backend.patches.verl", "verl_backend.workers.preemption", ("patches", "workers")),
        ("verl_backend.host_memory.plain_module", "verl_backend.workers.lora_checkpoint", ("host_memory", "workers")),
        ("verl_backend.weight_sync.route", "verl_backend.rollout.native_kwargs", ("weight_sync", "rollout")),
    ],
)
def test_each_folder_is_a_floor_of_its_own(tmp_path, module, target, folders):
    """The three arrows that ran back up between folders once in one layer (issue #46), put back one at a time into
    a copy of the tree: each is reported as an import up from one folder's floor to another's."""
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / (module.replace(".", "/") + ".py")
    package, _, name = target.rpartition(".")
    path.write_text(path.read_text() + f"\n\ndef _up():\n    from {package} import {name}\n")
    found = problems(tmp_path, PACKAGES, FOLDERS, LAYERS, APART)
    upward = [line for line in found if not line.startswith("import circle: ")]
    assert upward == [f"{module} imports {target}: up from '{folders[0]}' to '{folders[1]}'"], found


def test_layers_are_ordered_one_per_folder_of_verl_backend():
    """Each folder of ``verl_backend`` has a layer of its own (driver/aot excepted), and every layer is used."""
    inside = [f for f in FOLDERS if f.startswith("verl_backend") and f != "verl_backend.driver.aot"]
    assert len({FOLDERS[f] for f in inside}) == len(inside)
    assert set(FOLDERS.values()) - {"edge_export"} == set(LAYERS)


@pytest.mark.parametrize("module", ["verl_backend.patches.verl", "rl_tpu.device", "ray_cluster.placement"])
def test_the_real_tree_with_one_upward_import_added_is_reported(tmp_path, module):
    """The repository's own folders, copied, with one function-level import of the driver added low down."""
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n\ndef _up():\n    from verl_backend.driver import train\n")
    found = problems(tmp_path, PACKAGES, FOLDERS, LAYERS, APART)
    upward = [line for line in found if not line.startswith("import circle: ")]
    assert len(upward) == 1 and upward[0].startswith(f"{module} imports verl_backend.driver.train: up from "), found
    # the driver imports its way back down to the module: each circle found goes through it
    assert all(module in line for line in found if line.startswith("import circle: ")), found

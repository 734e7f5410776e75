"""Settings as parameters (issue #34 item 2): the job's settings record is read (``verl_backend.settings.current()``)
only at the process entry points named in ``ENTRY_POINTS``, once each; everything below takes the section its entry
point built (``EngineSettings``, ``RolloutSettings``, ``WeightSyncSettings``) or the values as arguments.

What counts as a read: a call ``current()`` or ``<module>.current()`` where ``<module>`` is a name the source bound to
``verl_backend.settings`` (``from verl_backend import settings as job_settings``), anywhere in a module of
``verl_backend/`` or ``rl_tpu/`` (``verl_backend/settings.py`` itself excepted: it defines the loader).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOADER = "verl_backend/settings.py"
# module -> the one function (qualified name) that reads the record there
ENTRY_POINTS = {
    "verl_backend/workers/engine.py": "_JobSettingsHere.initialize",  # a trainer engine's initialisation
    "verl_backend/rollout/adapter.py": "NativeServerAdapter.__init__",  # a rollout replica's worker
    "verl_backend/rollout/server.py": "NativeRolloutServer.__init__",  # the rollout server's construction
    "verl_backend/weight_sync/gloo_engine.py": "GlooCheckpointEngine.__init__",  # the pool sync engine
    "verl_backend/workers/platforms.py": "PlatformTPU.set_device",  # the TPU platform's device set-up
    "verl_backend/workers/slice_pool.py": "place_pools_on_slices",  # the TaskRunner's pools
    "verl_backend/models.py": "convert_default_model_here",  # VeRL's copy_to_local hook and the engines' build
}


def settings_reads(source: str) -> list[str]:
    """The qualified names of the functions of ``source`` that call ``current()`` of ``verl_backend.settings``, one
    entry per call (``"<module>"`` for a call at module level)."""
    tree = ast.parse(source)
    direct, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "verl_backend.settings":
            direct.update(a.asname or a.name for a in node.names if a.name == "current")
        elif isinstance(node, ast.ImportFrom) and node.module == "verl_backend":
            modules.update(a.asname or a.name for a in node.names if a.name == "settings")
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == "verl_backend.settings" and a.asname)
    found: list[str] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id in direct) or (
                    isinstance(f, ast.Attribute)
                    and f.attr == "current"
                    and isinstance(f.value, ast.Name)
                    and f.value.id in modules
                ):
                    found.append(".".join(scope) or "<module>")
            visit(child, scope)

    visit(tree, ())
    return found


def unexpected_reads(files: dict[str, str]) -> list[str]:
    """``path: function`` for each read of the record outside ``ENTRY_POINTS``, and for an entry point that reads
    it more than once."""
    bad = []
    for path, source in sorted(files.items()):
        if path == LOADER:
            continue
        for where, count in Counter(settings_reads(source)).items():
            if ENTRY_POINTS.get(path) != where:
                bad.append(f"{path}: {where} reads the settings record (take the section as a parameter)")
            elif count > 1:
                bad.append(f"{path}: {where} reads the settings record {count} times (once)")
    return bad


def _tree() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for d in ("verl_backend", "rl_tpu")
        for p in sorted((ROOT / d).rglob("*.py"))
    }


def test_only_the_entry_points_read_the_settings_record_once_each():
    files = _tree()
    assert unexpected_reads(files) == []
    for path, where in ENTRY_POINTS.items():  # each named entry point still is one (a stale name fails here)
        assert settings_reads(files[path]) == [where], path


def test_a_read_below_an_entry_point_is_reported():
    """Negative control: the real tree with one more ``current()`` call (a helper of the rollout server, and the
    entry point itself reading twice) is flagged, in both import styles."""
    files = _tree()
    server = "verl_backend/rollout/server.py"
    extra = files[server] + "\n\ndef _threads():\n    return current().num_threads\n"
    assert unexpected_reads({**files, server: extra}) == [
        f"{server}: _threads reads the settings record (take the section as a parameter)"
    ]
    sampling = "verl_backend/rollout/sampling.py"
    extra = files[sampling] + (
        "\n\ndef _seed():\n    from verl_backend import settings as job_settings\n\n"
        "    return job_settings.current().job_seed\n"
    )
    assert unexpected_reads({**files, sampling: extra}) == [
        f"{sampling}: _seed reads the settings record (take the section as a parameter)"
    ]
    twice = files[server].replace(
        "self.rl_tpu = rollout_settings(current()) if settings is None else settings",
        "self.rl_tpu = rollout_settings(current()) if settings is None else settings\n"
        "        self.job_seed = current().job_seed",
    )
    assert twice != files[server]
    assert unexpected_reads({**files, server: twice}) == [
        f"{server}: NativeRolloutServer.__init__ reads the settings record 2 times (once)"
    ]

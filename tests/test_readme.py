"""The README stays a front door: at most 150 lines and 1,500 words, prose lines at most 120 characters (code blocks
and tables may run longer), every page it links exists, and every `python -m`/console command it shows names a
module or script the project has."""

from __future__ import annotations

import re
import tomllib
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks and tables."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("|"):
            out.append((i, line))
    return out


def check(text: str, root: Path = ROOT) -> list[str]:
    """What breaks the README's limits (empty: none)."""
    problems = []
    lines = text.splitlines()
    if len(lines) > 150:
        problems.append(f"{len(lines)} lines (at most 150)")
    words = len(text.split())
    if words > 1500:
        problems.append(f"{words} words (at most 1500)")
    problems += [
        f"line {i}: {len(line)} characters of prose (at most 120)" for i, line in prose_lines(text) if len(line) > 120
    ]
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http") and not (root / link).exists():
            problems.append(f"link to {link}: no such file")
    return problems


def test_the_readme_keeps_its_limits() -> None:
    assert check(README.read_text()) == []


def test_the_check_fails_a_readme_over_its_limits(tmp_path) -> None:
    long_line = "word " * 30  # 150 characters of prose
    text = "\n".join(["# t", long_line, "[gone](docs/none.md)"] + ["x"] * 150)
    problems = check(text, tmp_path)
    assert any("lines (at most 150)" in p for p in problems)
    assert any("line 2:" in p for p in problems)
    assert any("docs/none.md" in p for p in problems)
    assert check("```\n" + long_line + "\n```\n| " + long_line + " |\n", tmp_path) == []  # code and tables may run


def test_the_commands_it_shows_exist() -> None:
    text = README.read_text()
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    for module in re.findall(r"python -m ([\w.]+)", text):
        assert find_spec(module) is not None, f"README runs python -m {module}: no such module"
    shown = set(
        re.findall(
            r"^(?:\$ )?([a-z][\w-]*) ",
            "\n".join(line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()),
            re.M,
        )
    )
    ours = {"verl", "litert", "rl-tpu"}
    assert ours & shown, shown  # the README shows the project's own commands
    assert ours & shown <= scripts, f"README shows {sorted(ours & shown)}, pyproject declares {sorted(scripts)}"
    for script in re.findall(r"^(\.ci/\w+|benchmarks/\w+\.py)", text, re.M):
        assert (ROOT / script).exists(), script

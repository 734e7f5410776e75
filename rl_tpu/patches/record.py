"""The record of every place rl-tpu touches another library outside its public API, and the version check that
refuses an untested library in one line.

A :class:`Patch` is one touch point: a name of another library that rl-tpu replaces (``apply`` set: a patch), or one
it only reads, calls or overrides (``apply`` ``None``: a private name, a protected method, a copied body). It names
what it touches (``target``), the module that holds it (``module``), the installed distribution (``library``) and
the versions of it the touch point was checked with (``versions``, a :class:`packaging.specifiers.SpecifierSet`),
why (``why``, one line) and ``upstream``: the upstream issue or pull request
(``https://github.com/OWNER/REPO/issues/N`` or ``/pull/N``), or, where none was found, the search that found none
(``none found: searched OWNER/REPO issues for 'QUERY'``, or ``GitHub`` for a search of every repository's issues,
see :func:`searched`). ``applied(module)`` tells whether the patch is in place, or the names read are there with the
shape used; the tests check it for every record, and :func:`problems` refuses a record with an empty field, an
upstream of neither form or a reason of more than one line.

Every access to a touched name goes through the module that holds its record (``verl_backend.patches``,
``rl_tpu.patches``, ``edge_export.litert_patches``), which checks the installed version first (:meth:`Patch.check`,
:func:`check_versions`): outside the range, :class:`UnsupportedVersionError` says so in one line with the install
command that fixes it.

This module is the bottom of the import order (``verl_backend`` and ``edge_export`` use it; it imports neither).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from rl_tpu.errors import BadInputError

MARK = "__rl_tpu_patch__"  # set on every replacement function: the target it stands in for
NONE_FOUND = "none found: searched "
_UPSTREAM_LINK = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+\b")
_SEARCH = re.compile(r"none found: searched [\w./-]+ issues for '[^']+'")  # OWNER/REPO, or GitHub (all of it)


class UnsupportedVersionError(BadInputError):
    """A library is installed at a version outside the range rl-tpu's touch points of it were checked with."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One touch point of another library (see the module docstring for the fields)."""

    target: str
    module: str
    library: str
    versions: SpecifierSet
    why: str
    upstream: str
    apply: Callable[[ModuleType], None] | None
    applied: Callable[[ModuleType], bool]

    def __post_init__(self) -> None:
        if isinstance(self.versions, str):
            object.__setattr__(self, "versions", SpecifierSet(self.versions))

    @property
    def replaces(self) -> bool:
        """Whether the record replaces the name (a patch) rather than only reading or overriding it."""
        return self.apply is not None

    def supports(self, version: str) -> bool:
        """Whether ``version`` of :attr:`library` is in the checked range (an unparsable version is not)."""
        try:
            return Version(version) in self.versions
        except InvalidVersion:
            return False

    def refusal(self, version: str) -> str:
        """The one line that refuses ``version`` of :attr:`library`, with the install command that fixes it."""
        spec = str(self.versions)
        pin = f"{self.library}{spec}" if spec.startswith("==") and "," not in spec else f'"{self.library}{spec}"'
        return (
            f"{self.library} {version} is outside the tested range {spec} of rl-tpu's patch {self.target}; "
            f"install {pin}"
        )

    def check(self) -> None:
        """Refuse the installed :attr:`library` outside :attr:`versions` (checked once per process; a library that
        is not installed passes: nothing of it is touched).

        Raises:
            UnsupportedVersionError: the one line of :meth:`refusal`.
        """
        if self.target in _CHECKED:
            return
        check_versions((self,))
        _CHECKED.add(self.target)


_CHECKED: set[str] = set()  # targets whose library passed Patch.check in this process


def searched(repo: str, query: str, note: str = "") -> str:
    """The ``upstream`` of a record for which no upstream issue was found: the repository and the query searched
    (``note``: anything found beside it, e.g. the pull request that introduced the behaviour)."""
    return f"{NONE_FOUND}{repo} issues for '{query}'" + (f" ({note})" if note else "")


def problems(patch: Patch) -> list[str]:
    """What is missing or malformed in ``patch`` (empty: a complete record).

    A record needs a target, module, library and a non-empty version range; ``why`` one non-empty line; and
    ``upstream`` starting with a GitHub issue or pull-request link or with the search that found none
    (:func:`searched`).
    """
    found = []
    for name in ("target", "module", "library"):
        if not isinstance(getattr(patch, name), str) or not getattr(patch, name).strip():
            found.append(f"no {name}")
    if not str(patch.versions):
        found.append("no version range")
    if not isinstance(patch.why, str) or not patch.why.strip() or "\n" in patch.why:
        found.append("why is not one non-empty line")
    upstream = patch.upstream if isinstance(patch.upstream, str) else ""
    if not upstream.strip():
        found.append("no upstream: give the upstream issue or pull request, or the search that found none")
    elif not (_UPSTREAM_LINK.match(upstream) or _SEARCH.match(upstream)):
        found.append(
            f"upstream {upstream!r} is neither a GitHub issue/PR link nor \"{NONE_FOUND}OWNER/REPO issues for 'QUERY'\""
        )
    if not callable(patch.applied) or (patch.apply is not None and not callable(patch.apply)):
        found.append("applied (and apply, when set) must be callable")
    return found


def installed_version(library: str) -> str | None:
    """The installed version of distribution ``library``, or ``None`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(library)
    except PackageNotFoundError:
        return None


def check_versions(patches: Iterable[Patch], installed: Mapping[str, str | None] | None = None) -> None:
    """Refuse, in one line, a touched library installed outside the range of any of ``patches``.

    Args:
        patches: the records to check.
        installed: library -> version to check instead of the installed ones (``None`` in it: not installed). A
            library that is not installed is skipped: nothing of it is touched.

    Raises:
        UnsupportedVersionError: the first record whose library's version is outside its range.
    """
    seen: dict[str, str | None] = {}
    for patch in patches:
        if patch.library not in seen:
            seen[patch.library] = (
                installed.get(patch.library) if installed is not None else installed_version(patch.library)
            )
        version = seen[patch.library]
        if version is not None and not patch.supports(version):
            raise UnsupportedVersionError(patch.refusal(version))


def mark(fn: Any, target: str) -> Any:
    """Mark ``fn`` as the replacement for ``target`` (see :func:`is_marked`); returns it."""
    setattr(fn, MARK, target)
    return fn


def is_marked(obj: Any, target: str) -> bool:
    """Whether ``obj`` is rl-tpu's replacement for ``target``."""
    return getattr(obj, MARK, None) == target


def wrap(owner: Any, name: str, make: Callable[[Any], Any], target: str) -> None:
    """Replace ``owner.name`` by ``make(original)``, marked for ``target``, with ``__wrapped__`` the original.

    Idempotent: an attribute that already is the replacement is left alone.
    """
    original = getattr(owner, name)
    if is_marked(original, target):
        return
    replacement = make(original)
    replacement.__wrapped__ = original
    setattr(owner, name, mark(replacement, target))


def resolve(obj: Any, path: str) -> Any:
    """``obj`` followed along the dotted attribute ``path`` (``""``: ``obj`` itself)."""
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def attribute_check(path: str, target: str) -> Callable[[ModuleType], bool]:
    """An ``applied`` check: the module's attribute ``path`` (dotted, e.g. ``"Cls.method"``) is marked for
    ``target``."""

    def applied(module: ModuleType) -> bool:
        return is_marked(resolve(module, path), target)

    return applied


def names_check(*paths: str) -> Callable[[ModuleType], bool]:
    """An ``applied`` check for a record that reads names: each dotted attribute path exists in the module."""

    def applied(module: ModuleType) -> bool:
        try:
            for path in paths:
                resolve(module, path)
        except AttributeError:
            return False
        return True

    return applied

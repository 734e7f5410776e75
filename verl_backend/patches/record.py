"""The record every rl-tpu patch is declared with, and the version check that refuses an untested library.

A :class:`Patch` names what it replaces (``target``), the module whose import applies it (``module``), the
installed distribution it patches (``library``) and the versions of it the patch was tested with (``versions``, a
:class:`packaging.specifiers.SpecifierSet`), the upstream issue or pull request it works around (``upstream``, or
``None``) and why (``why``, one line), and two functions of the imported module: ``apply`` and ``applied``, which
tells whether the patch is in place (the tests check every record with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from verl_backend.errors import BadInputError

MARK = "__rl_tpu_patch__"  # set on every replacement function: the target it stands in for


class UnsupportedVersionError(BadInputError):
    """A patched library is installed at a version outside the range its rl-tpu patches were tested with."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One narrow patch of a library (see the module docstring for the fields)."""

    target: str
    module: str
    library: str
    versions: SpecifierSet
    why: str
    upstream: str | None
    apply: Callable[[ModuleType], None]
    applied: Callable[[ModuleType], bool]

    def __post_init__(self) -> None:
        if isinstance(self.versions, str):
            object.__setattr__(self, "versions", SpecifierSet(self.versions))

    def supports(self, version: str) -> bool:
        """Whether ``version`` of :attr:`library` is in the tested range (an unparsable version is not)."""
        try:
            return Version(version) in self.versions
        except InvalidVersion:
            return False

    def refusal(self, version: str) -> str:
        """The one line that refuses ``version`` of :attr:`library`, with the install command that fixes it."""
        spec = str(self.versions)
        pin = f"{self.library}{spec}" if spec.startswith("==") and "," not in spec else f'"{self.library}{spec}"'
        return (f"{self.library} {version} is outside the tested range {spec} of rl-tpu's patch {self.target}; "
                f"install {pin}")


def installed_version(library: str) -> str | None:
    """The installed version of distribution ``library``, or ``None`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(library)
    except PackageNotFoundError:
        return None


def check_versions(patches: Iterable[Patch], installed: Mapping[str, str | None] | None = None) -> None:
    """Refuse, in one line, a patched library installed outside the range of any of ``patches``.

    Args:
        patches: the records to check.
        installed: library -> version to check instead of the installed ones (``None`` in it: not installed). A
            library that is not installed is skipped: its patches never apply.

    Raises:
        UnsupportedVersionError: the first patch whose library's version is outside its range.
    """
    seen: dict[str, str | None] = {}
    for patch in patches:
        if patch.library not in seen:
            seen[patch.library] = (installed.get(patch.library) if installed is not None
                                   else installed_version(patch.library))
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


def attribute_check(path: str, target: str) -> Callable[[ModuleType], bool]:
    """An ``applied`` check: the module's attribute ``path`` (dotted, e.g. ``"Cls.method"``) is marked for
    ``target``."""

    def applied(module: ModuleType) -> bool:
        obj: Any = module
        for part in path.split("."):
            obj = getattr(obj, part)
        return is_marked(obj, target)

    return applied

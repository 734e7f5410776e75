"""TPU slice topology: accelerator type + topology -> hosts, chips, cores and device mesh.

A Cloud TPU slice is named by an *accelerator type* ``<generation>-<N>`` and laid out by a
*topology* ``AxB`` (v5e, v6e: 2-D torus) or ``AxBxC`` (v4, v5p, v7x: 3-D torus) of chips.
The ``N`` in the name counts TensorCores on v4, v5p and v7x (two per chip: ``v4-16`` is
8 chips, ``2x2x2``) and chips on v5e and v6e (``v6e-16`` is 16 chips, ``4x4``).

Sources for the tables below (checked against Ray 2.60's ``ray._private.accelerators.tpu``):
Cloud TPU "TPU versions" / "Types and topologies" pages, GKE "Plan TPUs" (chips per VM:
4 on multi-host slices; v5e/v6e single-host VMs hold 1, 4 or 8 chips), "TPU7x (Ironwood)"
(two TensorCores per chip, accelerator type ``tpu7x-<cores>``, 4 chips per VM).

Nothing here imports torch or Ray: it is pure table arithmetic, safe in any process.

Example::

    >>> s = parse_slice("v4-16")
    >>> (s.topology, s.hosts, s.chips_per_host, s.chips, s.mesh_shape)
    ('2x2x2', 2, 4, 8, (2, 2, 2))

What each host of a slice offers Ray and has in its environment is ``rl_tpu.slice_hosts``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

__all__ = [
    "TopologyError",
    "Generation",
    "GENERATIONS",
    "SliceTopology",
    "VALID_CHIP_REQUESTS",
    "parse_slice",
    "default_topology",
    "valid_topologies",
    "accelerator_types",
    "check_chip_request",
]

# Ray accepts a TPU request of 1, 2, 4 or 8 whole chips (ray._private.accelerators.tpu).
VALID_CHIP_REQUESTS = (1, 2, 4, 8)


class TopologyError(ValueError):
    """A TPU accelerator type, topology or chip request that does not exist."""


@dataclass(frozen=True)
class Generation:
    """Fixed facts of one TPU generation.

    Attributes:
        name: Ray's accelerator version string (``ray.util.tpu`` ``accelerator_version``).
        type_prefix: what accelerator type names start with (``v6e`` in ``v6e-16``, ``tpu7x``).
        aliases: other prefixes users write (``v5e`` for ``v5litepod``, ``v7x`` for ``tpu7x``).
        cores_per_chip: TensorCores per chip.
        counts_cores: True when the number in the type name counts TensorCores, not chips.
        ndim: 2 (2-D torus) or 3 (3-D torus).
        devices_per_chip: devices one chip shows to the framework (v4/v5p fuse their two
            cores into one "megacore" device; v7x shows each core as its own device).
        max_grid: largest chip grid one slice may have (sorted axes), from the published
            maximum shapes (v4 16x16x16, v5p 16x16x24, v7x 8x16x16 in Ray's table).
        hbm_gib: high-bandwidth memory per chip, GiB (Cloud TPU "TPU versions" pages: v4 32,
            v5e 16, v5p 95, v6e 32, v7x 192; on v7x the chip's two devices share it).
    """

    name: str
    type_prefix: str
    aliases: tuple[str, ...]
    cores_per_chip: int
    counts_cores: bool
    ndim: int
    devices_per_chip: int
    max_grid: tuple[int, ...]
    hbm_gib: float

    def type_name(self, chips: int) -> str:
        """Canonical accelerator type for a slice of ``chips`` chips (``v4``, 8 -> ``v4-16``)."""
        n = chips * self.cores_per_chip if self.counts_cores else chips
        return f"{self.type_prefix}-{n}"


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v4", "v4", (), 2, True, 3, 1, (16, 16, 16), 32),
        Generation("v5p", "v5p", (), 2, True, 3, 1, (16, 16, 24), 95),
        Generation("v5litepod", "v5litepod", ("v5e",), 1, False, 2, 1, (16, 16), 16),
        Generation("v6e", "v6e", (), 1, False, 2, 1, (16, 16), 32),
        Generation("v7x", "tpu7x", ("v7x",), 2, True, 3, 2, (8, 16, 16), 192),
    )
}

_PREFIXES: dict[str, Generation] = {}
for _g in GENERATIONS.values():
    for _p in (_g.type_prefix, *_g.aliases):
        _PREFIXES[_p] = _g

# Chips a multi-host slice puts on each host (VM); every generation here uses 4.
_MULTI_HOST_CHIPS_PER_HOST = 4
# v5e / v6e single-host VMs (ct5lp-hightpu-{1,4,8}t, ct6e-standard-{1,4,8}t).
_SINGLE_HOST_2D = {"1x1": 1, "2x2": 4, "2x4": 8}
# Published 2-D shapes (v5e, v6e), smallest first.
_TOPOLOGIES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# Published 3-D shapes below one 64-chip cube, then whole-cube shapes; the default
# topology for a chip count is the first one of that size here.
_TOPOLOGIES_3D_DEFAULT = (
    "2x2x1",
    "2x2x2",
    "2x2x4",
    "2x4x4",
    "4x4x4",
    "4x4x8",
    "4x8x8",
    "8x8x8",
    "8x8x16",
    "8x16x16",
    "16x16x16",
    "16x16x24",
)
# v7x publishes a fixed list (GKE TPU7x page; Ray 2.60 VALID_TPU_TOPOLOGY["v7x"]).
_TOPOLOGIES_V7X = _TOPOLOGIES_3D_DEFAULT[:10]

_TYPE_RE = re.compile(r"^([a-z]+\d+[a-z]*)(?:-(\d+))?$")
_TOPO_RE = re.compile(r"^\d+(x\d+){1,2}$")


@dataclass(frozen=True)
class SliceTopology:
    """One TPU slice shape.

    Attributes:
        generation: Ray's accelerator version (``v4``, ``v5p``, ``v5litepod``, ``v6e``, ``v7x``).
        accelerator_type: canonical type as ``TPU_ACCELERATOR_TYPE`` spells it (``v6e-16``,
            ``v5litepod-8``, ``tpu7x-16``).
        topology: chip grid as ``TPU_TOPOLOGY`` spells it (``4x4``, ``2x2x2``).
        hosts: number of hosts (VMs) in the slice.
        chips_per_host: chips on each host (the Ray ``TPU`` resource per node).
        chips: chips in the slice (= hosts * chips_per_host).
        cores_per_chip: TensorCores per chip.
        mesh_shape: device mesh the framework sees: the chip grid, with a trailing
            axis of 2 on v7x (two devices per chip). ``prod(mesh_shape) == num_devices``.
    """

    generation: str
    accelerator_type: str
    topology: str
    hosts: int
    chips_per_host: int
    chips: int
    cores_per_chip: int
    mesh_shape: tuple[int, ...]

    @property
    def cores(self) -> int:
        """TensorCores in the slice."""
        return self.chips * self.cores_per_chip

    @property
    def chip_grid(self) -> tuple[int, ...]:
        """Chip counts along each torus axis, as in ``topology``."""
        return tuple(int(d) for d in self.topology.split("x"))

    @property
    def devices_per_chip(self) -> int:
        """Devices one chip shows to the framework (1, or 2 on v7x)."""
        return GENERATIONS[self.generation].devices_per_chip

    @property
    def hbm_gib(self) -> float:
        """High-bandwidth memory of one chip, GiB (:attr:`Generation.hbm_gib`)."""
        return GENERATIONS[self.generation].hbm_gib

    @property
    def num_devices(self) -> int:
        """Devices in the whole slice (= prod(mesh_shape))."""
        return self.chips * self.devices_per_chip

    @property
    def pod_type(self) -> str:
        """The type as Ray spells it (``ray.io/tpu-pod-type`` label): the accelerator type
        with Ray's generation prefix (``tpu7x-16`` -> ``v7x-16``; others unchanged)."""
        return f"{self.generation}-{self.accelerator_type.split('-')[1]}"

    @property
    def head_resource(self) -> str:
        """Ray resource only worker 0 of the slice offers, e.g. ``TPU-v6e-16-head``."""
        return f"TPU-{self.pod_type}-head"

    @property
    def ray_accelerator_type(self) -> str:
        """Ray's node accelerator type, e.g. ``TPU-V6E`` (resource ``accelerator_type:TPU-V6E``)."""
        return f"TPU-{self.generation.upper()}"

    @property
    def torch_tpu_topology(self) -> str:
        """Topology as ``TORCH_TPU_TOPOLOGY`` spells it: comma separated, 3-D padded with 1,
        a trailing 2 on v7x (``4x4`` -> ``4,4,1``; v7x ``2x2x2`` -> ``2,2,2,2``)."""
        dims = list(self.chip_grid) + [1] * (3 - len(self.chip_grid))
        if self.devices_per_chip > 1:
            dims.append(self.devices_per_chip)
        return ",".join(str(d) for d in dims)


def _generation_of(accelerator_type: str) -> tuple[Generation, int | None]:
    """Split ``v6e-16`` into (generation, 16); the number is None when absent (``v6e``)."""
    if not isinstance(accelerator_type, str):
        raise TopologyError(
            f"accelerator type {accelerator_type!r} is not a string; "
            f"write it like 'v6e-16', 'v5p-16', 'v5litepod-8', 'v4-16' or 'tpu7x-16'"
        )
    text = accelerator_type.strip().lower()
    if text.startswith("tpu-"):  # GKE / Ray sometimes write "TPU-V6E"
        text = text[4:]
    m = _TYPE_RE.match(text)
    gen = _PREFIXES.get(m.group(1)) if m else None
    if gen is None:
        known = ", ".join(sorted(_PREFIXES))
        raise TopologyError(
            f"unknown TPU accelerator type {accelerator_type!r}: it must be "
            f"<generation>-<size> with generation one of {known} (e.g. 'v6e-16', 'v4-16')"
        )
    return gen, (int(m.group(2)) if m.group(2) else None)


def valid_topologies(generation: str, chips: int | None = None) -> list[str]:
    """Topologies this module accepts for ``generation`` (Ray's version name or an alias),
    optionally only those with ``chips`` chips. Smallest first.

    v4/v5p accept the published sub-cube shapes and any ``AxBxC`` of multiples of 4
    (whole 4x4x4 cubes, the twisted-torus family) up to the pod size; v7x, v5e and v6e
    accept their published lists.
    """
    gen, _ = _generation_of(generation)
    shapes = _shapes(gen.name)
    if chips is not None:
        shapes = [t for t in shapes if _grid_chips(t) == chips]
    return list(shapes)


def _grid_chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


@functools.lru_cache(maxsize=None)
def _shapes(name: str) -> tuple[str, ...]:
    gen = GENERATIONS[name]
    if name == "v5litepod":  # v5e also offers a 2x8 (16-chip, 4-host) shape
        return tuple(sorted(_TOPOLOGIES_2D + ("2x8",), key=lambda t: (_grid_chips(t), t)))
    if gen.ndim == 2:
        return _TOPOLOGIES_2D
    if name == "v7x":
        return _TOPOLOGIES_V7X
    mx, my, mz = gen.max_grid
    shapes = set(_TOPOLOGIES_3D_DEFAULT[:4])
    for a in range(4, mx + 1, 4):
        for b in range(a, my + 1, 4):
            for c in range(b, mz + 1, 4):
                shapes.add(f"{a}x{b}x{c}")
    return tuple(sorted(shapes, key=lambda t: (_grid_chips(t), t)))


def default_topology(accelerator_type: str) -> str:
    """The standard topology of an accelerator type (``v6e-16`` -> ``4x4``, ``v4-16`` -> ``2x2x2``).

    Raises:
        TopologyError: unknown type, or a size with no standard shape (then give one explicitly).
    """
    gen, n = _generation_of(accelerator_type)
    if n is None:
        raise TopologyError(
            f"accelerator type {accelerator_type!r} has no size; write e.g. '{gen.type_name(16)}' or pass a topology"
        )
    chips = _chips_from_size(gen, n, accelerator_type)
    order = _TOPOLOGIES_2D if gen.ndim == 2 else _TOPOLOGIES_3D_DEFAULT
    for t in order:
        if _grid_chips(t) == chips and t in valid_topologies(gen.name):
            return t
    shapes = valid_topologies(gen.name, chips)
    hint = f"pass a topology ({', '.join(shapes)}) or " if shapes else ""
    raise TopologyError(
        f"{accelerator_type!r} ({chips} chips) has no standard {gen.name} topology; "
        f"{hint}use one of {', '.join(accelerator_types(gen.name))}"
    )


def accelerator_types(generation: str) -> list[str]:
    """Accelerator types with a standard topology, smallest first (``v6e`` -> ``['v6e-1', ...]``)."""
    gen, _ = _generation_of(generation)
    order = _TOPOLOGIES_2D if gen.ndim == 2 else _TOPOLOGIES_3D_DEFAULT
    valid = set(valid_topologies(gen.name))
    return [gen.type_name(_grid_chips(t)) for t in order if t in valid]


def _chips_from_size(gen: Generation, n: int, accelerator_type: str) -> int:
    if n <= 0 or (gen.counts_cores and n % gen.cores_per_chip):
        raise TopologyError(
            f"accelerator type {accelerator_type!r}: {gen.type_prefix} sizes count TensorCores "
            f"({gen.cores_per_chip} per chip), so the size must be a positive multiple of "
            f"{gen.cores_per_chip}; valid types: {', '.join(accelerator_types(gen.name))}"
        )
    return n // gen.cores_per_chip if gen.counts_cores else n


def parse_slice(accelerator_type: str, topology: str | None = None) -> SliceTopology:
    """Resolve an accelerator type (and optional topology) to a :class:`SliceTopology`.

    Args:
        accelerator_type: ``v4-16``, ``v5p-16``, ``v5litepod-8`` (or ``v5e-8``), ``v6e-16``,
            ``tpu7x-16`` (or ``v7x-16``); case-insensitive. A bare generation (``v6e``) is
            allowed when ``topology`` is given, as GKE node selectors name it.
        topology: chip grid ``AxB`` / ``AxBxC``; None picks :func:`default_topology`.

    Returns:
        The slice; ``accelerator_type`` in it is canonical (``v5e-8`` -> ``v5litepod-8``).

    Raises:
        TopologyError: unknown type, a topology that type does not have, or a topology whose
            chip count differs from the type's. The message names the input and valid choices.
    """
    gen, n = _generation_of(accelerator_type)
    if topology is None:
        topology = default_topology(accelerator_type)
    if not isinstance(topology, str) or not _TOPO_RE.match(topology.strip().lower()):
        raise TopologyError(
            f"topology {topology!r} for {accelerator_type!r} is not a chip grid like "
            f"{'4x4' if gen.ndim == 2 else '2x2x2'}; valid for {gen.name}: "
            f"{', '.join(valid_topologies(gen.name)[:12])}"
        )
    topology = topology.strip().lower()
    grid = tuple(int(d) for d in topology.split("x"))
    chips = math.prod(grid)
    if topology not in valid_topologies(gen.name):
        sized = valid_topologies(gen.name, chips if n is None else _chips_from_size(gen, n, accelerator_type))
        raise TopologyError(
            f"topology {topology!r} does not exist for {accelerator_type!r} ({gen.name}, "
            f"{gen.ndim}-D torus); valid: {', '.join(sized or valid_topologies(gen.name)[:12])}"
        )
    if n is not None:
        want = _chips_from_size(gen, n, accelerator_type)
        if want != chips:
            raise TopologyError(
                f"topology {topology!r} has {chips} chips but {accelerator_type!r} has {want}; "
                f"valid for it: {', '.join(valid_topologies(gen.name, want)) or '(none)'}, "
                f"or use accelerator type {gen.type_name(chips)!r}"
            )
    if gen.ndim == 2 and topology in _SINGLE_HOST_2D:
        per_host = _SINGLE_HOST_2D[topology]
    else:
        per_host = min(chips, _MULTI_HOST_CHIPS_PER_HOST)
    mesh = grid + ((gen.devices_per_chip,) if gen.devices_per_chip > 1 else ())
    return SliceTopology(
        generation=gen.name,
        accelerator_type=gen.type_name(chips),
        topology=topology,
        hosts=chips // per_host,
        chips_per_host=per_host,
        chips=chips,
        cores_per_chip=gen.cores_per_chip,
        mesh_shape=mesh,
    )


def check_chip_request(chips: float, spec: SliceTopology | None = None) -> int:
    """Validate a per-actor TPU request and return it as an int.

    Ray accepts 1, 2, 4 or 8 whole chips per actor; with ``spec`` the request must also fit
    on one host of that slice.

    Raises:
        TopologyError: fractional, non-positive, not in (1, 2, 4, 8), or more than a host has.
    """
    if (
        isinstance(chips, bool)
        or not isinstance(chips, (int, float))
        or chips != int(chips)
        or int(chips) not in VALID_CHIP_REQUESTS
    ):
        raise TopologyError(
            f"TPU request {chips!r} per actor is not a whole-chip count Ray accepts; use one of {VALID_CHIP_REQUESTS}"
        )
    n = int(chips)
    if spec is not None and n > spec.chips_per_host:
        fits = [c for c in VALID_CHIP_REQUESTS if c <= spec.chips_per_host]
        raise TopologyError(
            f"TPU request {n} per actor exceeds the {spec.chips_per_host} chips of one "
            f"{spec.accelerator_type} host; use one of {tuple(fits)} and more actors"
        )
    return n

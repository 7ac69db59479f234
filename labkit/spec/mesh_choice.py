"""Which meshes a training run may take, in the order they are tried: pure, no torch.

A single strategy gets every rank on its axis. A composition takes the mesh it
is given (``dp=2, tp=2``); without one, the lab's current mesh when its axes are
the ones needed, else every split of the ranks over the axes, the most even
first (``spec.train_config`` takes the first the model allows). Each candidate
comes with the reason it is tried, which the report shows (``mesh_reason``).
"""

from __future__ import annotations

from labkit.spec.mesh import MeshSpec

GIVEN = "given"


def even_splits(world_size: int, axes: int) -> list[tuple[int, ...]]:
    """Every way to split ``world_size`` ranks over ``axes`` axes of size >= 2, most even first."""
    def splits(remaining: int, count: int):
        if count == 1:
            if remaining >= 2:
                yield (remaining,)
            return
        for size in range(2, remaining + 1):
            if remaining % size == 0:
                for rest in splits(remaining // size, count - 1):
                    yield (size, *rest)

    return sorted(splits(world_size, axes), key=lambda shape: (max(shape) / min(shape), shape))


def mesh_candidates(strategy: str, needed: list[str], world_size: int, mesh: dict | None,
                    lab_mesh: MeshSpec | None) -> list[tuple[MeshSpec, str]]:
    """The meshes to try for a strategy needing axes ``needed``, each with the reason; ValueError when none."""
    if mesh:
        spec = MeshSpec.from_axes(mesh, world_size)
        if set(spec.names) != set(needed):
            raise ValueError(
                f"strategy {strategy} uses mesh axes {', '.join(needed)}; the mesh given has "
                f"{', '.join(spec.names)}"
            )
        return [(spec, GIVEN)]
    if len(needed) == 1:
        return [(MeshSpec((needed[0],), (world_size,)), GIVEN)]
    if lab_mesh is not None and set(lab_mesh.names) == set(needed):
        return [(lab_mesh, "the lab's mesh")]
    candidates = [(MeshSpec(tuple(needed), shape), f"the most even split of {world_size} ranks that fits")
                  for shape in even_splits(world_size, len(needed))]
    if not candidates:
        raise ValueError(
            f"{world_size} ranks cannot be split over {len(needed)} axes ({', '.join(needed)}) of at least 2 "
            f"ranks each: use a single strategy, or a lab whose size has such factors (4 ranks: "
            f"{' x '.join(f'{axis}=2' for axis in needed[:2])})"
        )
    return candidates

"""The catalogues' shape: how many projects of which size, in the large catalogue and in its
baseline with the same size classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

#: Big-project tiers: (objects per project at --largest 50000, share of the projects). The rest
#: of the projects share the rest of the objects evenly (about 35 each at the defaults).
TIERS = ((50_000, 0.0002), (10_000, 0.0015), (1_000, 0.025), (100, 0.25))
#: Every tier has at least this many projects, so the baseline has each size class too.
MIN_PER_TIER = 3


@dataclass(frozen=True)
class Shape:
    """Projects per size: `counts[i]` projects of `sizes[i]` objects, then the filler projects
    sharing `filler_objects`."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    filler_projects: int
    filler_objects: int

    @property
    def projects(self) -> int:
        return sum(self.counts) + self.filler_projects

    @property
    def objects(self) -> int:
        return (
            sum(c * s for c, s in zip(self.counts, self.sizes, strict=True)) + self.filler_objects
        )

    @property
    def filler_size(self) -> int:
        return self.filler_objects // self.filler_projects

    def size_class(self, objects: int) -> int:
        """A project's class: its tier, or the filler size (filler projects differ by one)."""
        return objects if objects in self.sizes else self.filler_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "projects": self.projects,
            "property_objects": self.objects,
            "projects_by_size": {
                **{str(s): c for s, c in zip(self.sizes, self.counts, strict=True)},
                f"{self.filler_size}-{self.filler_size + 1}": self.filler_projects,
            },
        }


def _tier_counts(projects: int) -> tuple[int, ...]:
    return tuple(max(MIN_PER_TIER, round(share * projects)) for _, share in TIERS)


def catalogue_shape(projects: int, objects: int, largest: int) -> Shape:
    sizes = tuple(max(1, size * largest // 50_000) for size, _ in TIERS)
    counts = _tier_counts(projects)
    filler_projects = projects - sum(counts)
    filler_objects = objects - sum(c * s for c, s in zip(counts, sizes, strict=True))
    if filler_projects < 1 or filler_objects < filler_projects:
        raise SystemExit(
            f"{projects} projects / {objects} objects leave no room for the filler projects next"
            f" to the big tiers {dict(zip(sizes, counts, strict=True))}: raise --objects or lower"
            " --largest"
        )
    return Shape(sizes, counts, filler_projects, filler_objects)


def baseline_shape(large: Shape, projects: int) -> Shape:
    """The same size classes in a smaller catalogue: the same filler size, fewer projects."""
    counts = _tier_counts(projects)
    filler_projects = projects - sum(counts)
    if filler_projects < 1:
        raise SystemExit(f"--baseline-projects {projects} is too small for the tiers")
    return Shape(large.sizes, counts, filler_projects, filler_projects * large.filler_size)


def by_class(shape: Shape, sizes: dict[UUID, int]) -> dict[int, list[UUID]]:
    """Project ids per size class, in random order (the plan's order is random)."""
    classes: dict[int, list[UUID]] = {}
    for project_id, objects in sizes.items():
        classes.setdefault(shape.size_class(objects), []).append(project_id)
    return dict(sorted(classes.items(), reverse=True))

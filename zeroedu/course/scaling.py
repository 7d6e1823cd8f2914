"""Notebook 07's results by name: one stage trained at one world size, as a small dataclass.

`zeroedu.launch` returns one result per rank, and notebook 07's rank function returns one `course.train` result
per stage, so a raw result reads `measured[n][rank][stage]["memory"]`. `scaling_runs` turns that into
`runs[stage, n]`, a `ScalingRun` whose fields say what they hold (rank 0's numbers, and every rank's model states).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zeroedu.theory.vocab import MODEL_STATES


@dataclass(frozen=True)
class ScalingRun:
    """One stage trained on `world_size` ranks: rank 0's bytes, and the model states of every rank."""

    stage: int
    world_size: int
    psi: int                                # parameters of the model (unpadded)
    layout: list[int]                       # elements of each bucket (stages 0-2) or unit (stage 3), unpadded
    model_states: int                       # rank 0's model-state bytes at rest, between steps
    model_states_per_rank: list[int]        # the same for every rank, in rank order
    memory: dict[str, int]                  # rank 0's resident bytes by category, at rest
    peak: dict[str, int]                    # rank 0's bytes by category at the tracked step's peak ({} if none)
    peak_phase: str | None                  # the phase that peak fell in ("forward", "backward", "step")
    bucket_bytes_high: int | None           # stages 2-3: the most bucket-buffer bytes alive at once
    largest_bucket: int                     # elements of the largest bucket or unit, padded to N pieces

    @property
    def peak_model_states(self) -> int:
        """Rank 0's model-state bytes at the tracked step's peak."""
        return sum(self.peak.get(c, 0) for c in MODEL_STATES)


def scaling_run(stage: int, world_size: int, per_rank: Sequence[Mapping]) -> ScalingRun:
    """A ScalingRun from `course.train`'s result on every rank (in rank order) for one stage."""
    r0 = per_rank[0]
    return ScalingRun(
        stage=stage, world_size=world_size, psi=r0["psi"], layout=list(r0["layout"]),
        model_states=sum(r0["memory"].get(c, 0) for c in MODEL_STATES),
        model_states_per_rank=[sum(r["memory"].get(c, 0) for c in MODEL_STATES) for r in per_rank],
        memory=dict(r0["memory"]), peak=dict(r0.get("peak") or {}), peak_phase=r0.get("peak_phase"),
        bucket_bytes_high=r0.get("bucket_bytes_high"),
        largest_bucket=max(padded for *_, padded in r0["buckets"]))


def scaling_runs(measured: Mapping[int, Sequence[Mapping[int, Mapping]]]) -> dict[tuple[int, int], ScalingRun]:
    """{N: launch results, one {stage: course.train result} per rank} -> {(stage, N): ScalingRun}."""
    return {(stage, n): scaling_run(stage, n, [rank[stage] for rank in per_rank])
            for n, per_rank in measured.items() for stage in per_rank[0]}


__all__ = ["ScalingRun", "scaling_run", "scaling_runs"]

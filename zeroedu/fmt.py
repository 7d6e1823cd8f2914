"""Text forms of numbers that the course prints, kept free of heavy imports (the grader's kernels use them too)."""

from __future__ import annotations

from collections.abc import Iterable


def approx(x: float | Iterable[float], digits: int = 4) -> str:
    """`x` for reading, not for comparing: "≈4.8832" (a list: "≈4.8832, ≈4.8236").

    Use it for floats computed by CPU kernels (losses, norms, fp16/bf16 results): their last digits differ
    between AVX2, AVX-512 and NEON machines, so nbval masks whatever follows "≈". Print the check that holds on
    every machine (an exact count, or a comparison with a stated tolerance) beside it.
    """
    if isinstance(x, Iterable):
        return ", ".join(approx(v, digits) for v in x)
    return f"≈{float(x):.{digits}f}"

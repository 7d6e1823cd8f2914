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


BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def byte_unit(max_bytes: float, unit: str | None = None) -> tuple[str, float]:
    """(name, bytes in one) of `unit`, or with unit None the largest binary unit that `max_bytes` reaches."""
    if unit is not None:
        if unit not in BYTE_UNITS:
            raise ValueError(f"unit must be one of {', '.join(BYTE_UNITS)}, got {unit!r}")
        return unit, BYTE_UNITS[unit]
    for name in ("GiB", "MiB", "KiB"):
        if max_bytes >= BYTE_UNITS[name]:
            return name, BYTE_UNITS[name]
    return "B", 1


def fmt_bytes(n: float, unit: str | None = None, digits: int = 1, *, label: str | None = None,
              grouping: bool = True, width: int | None = None) -> str:
    """1536 -> '1.5 KiB'. Binary units unless `unit` says otherwise ('GB' is 1e9, as model sizes are quoted).

    The course's tables and reports keep their own styles through the keywords: `label` is the unit name printed
    ("" for none, where a column header names the unit), `grouping` the thousands separators, `width` the
    number's minimum width.
    """
    name, scale = byte_unit(abs(n), unit)
    spec = f"{'' if width is None else width}{',' if grouping else ''}"
    number = f"{int(n):{spec}}" if name == "B" else f"{n / scale:{spec}.{digits}f}"
    label = name if label is None else label
    return f"{number} {label}" if label else number

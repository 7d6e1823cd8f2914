"""Test harness for exercise 10, "spot the errors": a crib sheet of numeric claims, some of them planted errors.

The learner writes two functions:
- `correct(claim) -> float`: the true value of the quantity the claim states, in the claim's unit, computed by
  calling zeroedu (zeroedu.theory, or a short zeroedu.launch);
- `is_true(claim) -> bool`: whether the claim's stated number is right within the claim's tolerance.

The checks compare them with closed forms written here from the ZeRO, ZeRO-Offload and ZeRO++ papers, not with
zeroedu.theory (the code the learner calls), so a check cannot pass because both sides share a bug. Hidden tests
run the same functions on a second sheet whose numbers the learner has not seen. That sheet is not in this
module (nor anywhere in the zeroedu package, which the learner's kernel can import and read): it is written in
the solution's hidden test cells, which `zeroedu grade` runs in its own process and never sends to the kernel,
and solutions/ is hidden inside the grading sandbox.

`check_calls_zeroedu` is the "a call, not a literal" check. It traces each call of `correct` where the learner's
code runs and fails when no zeroedu function ran, or when the learner's code reached zeroedu.grading (this
module's `reference` is the grader's answer key, not a correction). Then it asks `correct` again about each claim
with its parameters changed one at a time (`variants`: same id, same wording, a different true value) and fails a
claim whose answer never moves: a number typed for one sheet, behind a token call, does not follow the reference.

    from zeroedu.grading import ex10
    ex10.check_numbers(correct, ex10.SHEET_A); ex10.check_marks(is_true, ex10.SHEET_A)
    ex10.check_calls_zeroedu(correct, ex10.SHEET_A)
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zeroedu.grading.remote import in_kernel

__all__ = ["KINDS", "SHEET_A", "Claim", "check_calls_zeroedu", "check_marks", "check_numbers", "make_claim",
           "reference", "sheet_markdown", "variants"]

GB = 10**9


@dataclass(frozen=True)
class Claim:
    """One line of the crib sheet: `stated` is the number it gives, in `unit`, for the quantity `kind` with
    `params`; it is true when within `tolerance` (relative) of the true value."""

    id: str
    kind: str
    params: dict[str, Any] = field(hash=False)
    stated: float
    unit: str
    zh: str
    en: str
    tolerance: float = 0.05


# kind -> (what it is, its parameters, the unit of the value)
KINDS = {
    "model_states": ("model-state bytes per GPU, mixed-precision Adam (ZeRO paper, K = 12)", "psi, n, stage", "GB"),
    "comm_ratio": ("bytes one GPU sends per optimizer step, as a multiple of DDP's with the same accumulation",
                   "stage, n, accum", "x DDP"),
    "offload_pcie": ("bytes one GPU moves over PCIe per step, ZeRO-2 + CPU optimizer offload, bf16", "psi, n", "GB"),
    "zeropp_ratio": ("bytes crossing nodes per step with the given ZeRO++ parts, as a multiple of plain ZeRO-3's",
                     "qwz, hpz, qgz", "x ZeRO-3"),
    "hpz_memory": ("extra bytes per GPU that hpZ's secondary copy costs, bf16, nodes of g GPUs", "psi, g", "GB"),
    "allgather_sent": ("bytes one GPU sends in a ring all-gather of a tensor of `gb` GB", "gb, n", "GB"),
    "min_gpus": ("the fewest GPUs of `gpu_gb` GB whose memory holds ZeRO-3's model states (nothing else)",
                 "psi, gpu_gb", "GPUs"),
}


def reference(claim: Claim) -> float:
    """The true value, from the papers' closed forms (written here independently of zeroedu.theory)."""
    p = claim.params
    if claim.kind == "model_states":
        n, s = p["n"], p["stage"]
        per_param = 2 / (n if s >= 3 else 1) + 2 / (n if s >= 2 else 1) + 12 / (n if s >= 1 else 1)
        return per_param * p["psi"] / GB
    if claim.kind == "comm_ratio":
        a, s = p["accum"], p["stage"]
        # in units of (N-1)/N x the 16-bit model: DDP all-reduces once per step (2); stage 1 reduce-scatters once and
        # all-gathers once (2); stage 2 reduce-scatters every micro-step (a + 1); stage 3 gathers twice and
        # reduce-scatters every micro-step (3a)
        return {0: 2, 1: 2, 2: a + 1, 3: 3 * a}[s] / 2
    if claim.kind == "offload_pcie":
        return 4 * p["psi"] / p["n"] / GB          # bf16 gradient shard down (2) + bf16 parameter shard up (2)
    if claim.kind == "zeropp_ratio":
        gather = 0.5 if p["qwz"] else 1.0
        return (gather + (0.0 if p["hpz"] else gather) + (0.25 if p["qgz"] else 1.0)) / 3
    if claim.kind == "hpz_memory":
        return 2 * p["psi"] / p["g"] / GB
    if claim.kind == "allgather_sent":
        return p["gb"] * (p["n"] - 1) / p["n"]
    if claim.kind == "min_gpus":
        return math.ceil(16 * p["psi"] / (p["gpu_gb"] * GB) - 1e-12)
    raise ValueError(f"unknown claim kind {claim.kind!r}; known: {sorted(KINDS)}")


def make_claim(id: str, kind: str, stated: float, zh: str, en: str, **params) -> Claim:
    """A claim of `kind`, in that kind's unit (the solution's hidden cells build the second sheet with it)."""
    if kind not in KINDS:
        raise ValueError(f"unknown claim kind {kind!r}; known: {sorted(KINDS)}")
    return Claim(id, kind, params, stated, KINDS[kind][2], zh, en)


_c = make_claim


SHEET_A = [
    _c("A1", "model_states", 13.0, "13B 模型在 16 张卡上用 ZeRO-2，每卡模型状态约 13 GB（16Ψ/N）。",
       "13B on 16 GPUs with ZeRO-2 keeps about 13 GB of model states per GPU (16Ψ/N).", psi=13e9, n=16, stage=2),
    _c("A2", "model_states", 1.875, "7.5B 模型在 64 张卡上用 ZeRO-3，每卡模型状态约 1.9 GB。",
       "7.5B on 64 GPUs with ZeRO-3 keeps about 1.9 GB of model states per GPU.", psi=7.5e9, n=64, stage=3),
    _c("A3", "comm_ratio", 3.0, "ZeRO-3 每步通信量是 DDP 的 3 倍：三次集合通信，而 DDP 只有一次。",
       "ZeRO-3 sends 3x DDP's bytes per step: three collectives against DDP's one.", stage=3, n=16, accum=1),
    _c("A4", "comm_ratio", 1.0, "ZeRO-1 开 8 步梯度累积，每个优化器步的通信量与 DDP 相同。",
       "ZeRO-1 with 8 accumulation steps sends what DDP sends per optimizer step.", stage=1, n=8, accum=8),
    _c("A5", "comm_ratio", 1.0, "ZeRO-2 开 4 步梯度累积，每个优化器步的通信量也与 DDP 相同。",
       "ZeRO-2 with 4 accumulation steps also sends what DDP sends per optimizer step.", stage=2, n=8, accum=4),
    _c("A6", "offload_pcie", 7.0,
       "ZeRO-Offload（Stage 2，7B，8 卡，bf16）每卡每步经 PCIe 传约 7 GB：本卡那一片的 fp32 梯度传到 CPU、"
       "更新后的 fp32 参数传回 GPU（各 4Ψ/N）。",
       "ZeRO-Offload (stage 2, 7B, 8 GPUs, bf16) moves about 7 GB per GPU per step over PCIe: the GPU's shard of fp32 "
       "gradients to the CPU and the updated fp32 parameters back to the GPU (4Ψ/N each way).", psi=7e9, n=8),
    _c("A7", "zeropp_ratio", 0.25, "ZeRO++ 三项（qwZ、hpZ、qgZ）全开，跨节点通信量约为 ZeRO-3 的 1/4。",
       "With all of ZeRO++ (qwZ, hpZ, qgZ), the bytes crossing nodes are about 1/4 of ZeRO-3's.",
       qwz=True, hpz=True, qgz=True),
    _c("A8", "hpz_memory", 0.0, "hpZ 只改通信路径，不占额外显存（70B，每节点 8 卡）。",
       "hpZ only reroutes communication and costs no extra GPU memory (70B, nodes of 8 GPUs).", psi=70e9, g=8),
    _c("A9", "allgather_sent", 4.0, "在 8 张卡上 all-gather 一个 4 GB 的张量，每卡都要把整个张量发送一遍，即 4 GB。",
       "An all-gather of a 4 GB tensor over 8 GPUs has every GPU send the whole tensor once: 4 GB each.", gb=4.0, n=8),
    _c("A10", "min_gpus", 14, "70B 模型用 ZeRO-3，只算模型状态，至少需要 14 张 80 GB 的卡。",
       "A 70B model at ZeRO-3 needs at least 14 GPUs of 80 GB for its model states alone.", psi=70e9, gpu_gb=80),
]

# The second sheet (hidden tests) lives in solutions/ex10_spot_the_errors.ipynb, cell `ex10-hidden-numbers`.


def sheet_markdown(sheet: list[Claim]) -> str:
    """The crib sheet as a Markdown table: id, 中文, English, the quantity and its parameters."""
    rows = ["| # | 中文 | English | quantity (`kind`: params) |", "|---|---|---|---|"]
    for c in sheet:
        params = ", ".join(f"psi={v / 1e9:g}B" if k == "psi" else f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in c.params.items())
        rows.append(f"| {c.id} | {c.zh} | {c.en} | `{c.kind}`: {params}; stated {c.stated:g} {c.unit} |")
    return "\n".join(rows)


def _is_true(claim: Claim) -> bool:
    want = reference(claim)
    return abs(claim.stated - want) <= claim.tolerance * abs(want)


# A pointed hint for each mistake we expect: kind -> [(the mistaken value as a function of the claim, hint)]
_MISTAKES: dict[str, list[tuple[Callable[[Claim], float], str]]] = {
    "model_states": [
        (lambda c: 16 * c.params["psi"] / c.params["n"] / GB,
         "that is 16Ψ/N, stage 3's figure: below stage 3 the unsharded terms stay whole on every GPU"),
        (lambda c: 4 * c.params["psi"] / GB + 12 * c.params["psi"] / c.params["n"] / GB,
         "that is stage 1's 4Ψ + 12Ψ/N: check which terms this stage shards"),
    ],
    "comm_ratio": [
        (lambda c: 2.0 if c.params["stage"] == 3 else math.nan,
         "stage 3 sends 3Ψ against DDP's 2Ψ (an all-reduce is two passes): 1.5x, not 2x"),
        (lambda c: {0: 1, 1: 1, 2: 1, 3: 1.5}[c.params["stage"]] if c.params["accum"] > 1 else math.nan,
         "that ignores gradient accumulation: stages 2 and 3 communicate at every micro-step, DDP and stage 1 once "
         "per optimizer step"),
        (lambda c: float(c.params["accum"]) if c.params["stage"] == 2 and c.params["accum"] > 1 else math.nan,
         "that repeats all of DDP's 2Ψ at every micro-step; stage 2 repeats only the reduce-scatter (Ψ) and "
         "all-gathers the updated parameters once per optimizer step"),
    ],
    "offload_pcie": [
        (lambda c: 2 * c.params["psi"] / c.params["n"] / GB,
         "that counts one direction only: the gradient shard goes down AND the updated parameter shard comes back"),
        (lambda c: 8 * c.params["psi"] / c.params["n"] / GB,
         "that counts fp32 copies: both directions travel in the 16-bit compute dtype"),
    ],
    "allgather_sent": [(lambda c: c.params["gb"] / c.params["n"],
                        "that is the size of one rank's piece; in a ring each GPU forwards N-1 pieces"),
                       (lambda c: c.params["gb"],
                        "that is the whole tensor; a GPU never sends the piece it receives last: N-1 of N pieces")],
    "hpz_memory": [(lambda c: 0.0, "hpZ keeps a secondary copy of the parameters sharded inside the node: 2Ψ/g")],
}


def _hint(claim: Claim, got: float) -> str:
    for wrong, hint in _MISTAKES.get(claim.kind, []):
        value = wrong(claim)
        if math.isclose(got, value, rel_tol=1e-6, abs_tol=1e-12):
            return hint
    what, params, unit = KINDS[claim.kind]
    return f"'{claim.kind}' is {what} ({params}), in {unit}"


def check_numbers(correct: Callable[[Claim], float], sheet: list[Claim]) -> None:
    """Raise AssertionError naming every claim whose corrected number is wrong, with a pointed hint."""
    wrong = []
    for claim in sheet:
        got = correct(claim)
        if isinstance(got, bool) or not isinstance(got, int | float):
            raise AssertionError(f"claim {claim.id}: correct() returned {got!r}; return a number in {claim.unit}")
        want = reference(claim)
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9):
            wrong.append(f"claim {claim.id}: you gave {got:g} {claim.unit}, which is not right: "
                         f"{_hint(claim, got)}")
    assert not wrong, "; ".join(wrong)


def check_marks(is_true: Callable[[Claim], bool], sheet: list[Claim]) -> None:
    """Raise AssertionError naming every claim marked the wrong way."""
    wrong = []
    for claim in sheet:
        got = is_true(claim)
        if not isinstance(got, bool):
            raise AssertionError(f"claim {claim.id}: is_true() returned {got!r}; return True or False")
        if got != _is_true(claim):
            how = "true" if got else "false"
            wrong.append(f"claim {claim.id} is not {how}: it states {claim.stated:g} {claim.unit}; compare with the "
                         f"true value within its tolerance of {claim.tolerance:.0%}")
    assert not wrong, "; ".join(wrong)


_ZEROEDU = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the zeroedu package
_GRADING = os.path.dirname(os.path.abspath(__file__))
# The grading machinery that runs next to the learner's code in the kernel (the sandbox's audit hook on imports and
# opens, the kernel's blocks and replies): its frames are not the learner reaching for answers.
_MACHINERY = (os.path.join(_GRADING, "guard") + os.sep, os.path.join(_GRADING, "kernel.py"),
              os.path.join(_GRADING, "remote.py"))


def _calls_zeroedu(fn: Callable, *args) -> tuple[Any, bool, list[str]]:
    """Run fn(*args); report whether any zeroedu function outside zeroedu.grading ran meanwhile, and the
    zeroedu.grading functions it reached (the answer key is not a correction)."""
    seen, graders = [False], []

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(_GRADING + os.sep):
                if not name.startswith(_MACHINERY) and frame.f_code.co_name not in graders:
                    graders.append(frame.f_code.co_name)
            elif name.startswith(_ZEROEDU + os.sep):
                seen[0] = True
    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(old)
    return out, seen[0], graders


# Values a claim's parameters take in `variants`: sizes and counts people quote.
_PSI = (1.3e9, 2.7e9, 6.7e9, 7e9, 13e9, 20e9, 34e9, 65e9, 70e9, 175e9)
_DRAW: dict[str, dict[str, tuple]] = {
    "model_states": {"psi": _PSI, "n": (2, 4, 8, 16, 32, 64, 128, 256), "stage": (0, 1, 2, 3)},
    "comm_ratio": {"stage": (0, 1, 2, 3), "n": (2, 4, 8, 16, 64), "accum": (1, 2, 3, 4, 8, 16)},
    "offload_pcie": {"psi": _PSI, "n": (1, 2, 4, 8, 16, 32)},
    "zeropp_ratio": {"qwz": (False, True), "hpz": (False, True), "qgz": (False, True)},
    "hpz_memory": {"psi": _PSI, "g": (2, 4, 8, 16)},
    "allgather_sent": {"gb": (0.5, 1.0, 2.0, 3.0, 6.0, 10.0), "n": (2, 3, 4, 8, 16, 64)},
    "min_gpus": {"psi": _PSI, "gpu_gb": (16, 24, 32, 40, 48, 80, 141)},
}


def variants(claim: Claim) -> list[Claim]:
    """The same claim (id, kind, wording) with one parameter changed at a time, to every other value of `_DRAW`,
    kept where the change moves the true value: what a computed correction follows and a typed number does not."""
    want, out = reference(claim), []
    for key, value in claim.params.items():
        for other in _DRAW[claim.kind][key]:
            if other == value:
                continue
            params = {**claim.params, key: other}
            probe = Claim(claim.id, claim.kind, params, claim.stated, claim.unit, claim.zh, claim.en, claim.tolerance)
            if not math.isclose(reference(probe), want, rel_tol=1e-6):
                out.append(probe)
    return out

def _params(claim: Claim) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in claim.params.items())


def check_calls_zeroedu(correct: Callable[[Claim], float], sheet: list[Claim]) -> None:
    """Raise AssertionError naming every claim whose correction is not a computation with zeroedu: it ran no
    zeroedu function (a typed literal), it reached zeroedu.grading (the answer key), or it gave the same number
    when the claim's parameters changed its true value (a literal behind a token call)."""
    # traced where the learner's code runs: in the graded kernel (the grader only holds a stand-in for correct)
    traced = {c.id: in_kernel(_calls_zeroedu, correct, c) for c in sheet}
    typed = [i for i, (_, seen, _) in traced.items() if not seen]
    keyed = {i: graders for i, (_, _, graders) in traced.items() if graders}
    problems = []
    if typed:
        problems.append(f"correct() returned a number without calling any zeroedu function for claim(s) "
                        f"{', '.join(typed)}: compute each value with zeroedu.theory (or a short zeroedu.launch) so "
                        "that the correction holds for any sheet, not just this one")
    if keyed:
        names = sorted({g for gs in keyed.values() for g in gs})
        problems.append(f"correct() reached the grader's own code in zeroedu.grading ({', '.join(names)}) for "
                        f"claim(s) {', '.join(keyed)}: that is the answer key, not a correction; compute each value "
                        "with zeroedu.theory")
    stuck = []
    for claim in sheet:
        first = traced[claim.id][0]
        probes = variants(claim)
        if not probes or isinstance(first, bool) or not isinstance(first, int | float):
            continue
        answers = [correct(probe) for probe in probes]
        if all(isinstance(a, int | float) and not isinstance(a, bool) and math.isclose(a, first, rel_tol=1e-9)
               for a in answers):
            probe = probes[0]
            stuck.append(f"claim {claim.id} (with {_params(probe)} its true value is {reference(probe):g} "
                         f"{claim.unit}, yet correct() still gives {first:g})")
    if stuck:
        problems.append("correct() gave the same number whatever the claim's parameters, so it does not follow "
                        f"them as a computation does: {'; '.join(stuck)}. A number typed for this sheet, behind a "
                        "call, is still a typed number")
    assert not problems, "; ".join(problems)

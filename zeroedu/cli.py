"""`zeroedu <command>`: one entry point; each command lives next to the code it drives."""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help). Modules are imported only when their command runs,
# so `zeroedu --help` is instant and a broken optional piece cannot break the others.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "tour": ("zeroedu.course.tour", "main", "train the embedded default at every stage; memory and comm vs theory"),
    "bench": ("zeroedu.bench", "main", "step time and memory of each stage against torch's own peers"),
    "plan": ("zeroedu.theory.planner", "main", "which stage for which model, cluster and network"),
    "grade": ("zeroedu.course.selfgrade", "main",
              "grade your own notebook (no sandbox, every hint) or others' work (sandboxed; table, JSON, CSV)"),
    "progress": ("zeroedu.course.progress", "main", "which lessons you have run and which exercises pass"),
    "build-exercises": ("zeroedu.grading.build", "main", "generate exercises/ from solutions/"),
    "consolidate": ("zeroedu.checkpoint", "main", "merge a sharded checkpoint into one fp32 state_dict"),
    "doctor": ("zeroedu.doctor", "main", "check that this machine can run the course, with fixes"),
    "check-claims": ("zeroedu.course.claims", "main", "check a ZeRO crib sheet's claims: ❌ 原文 → ✅ 正确说法"),
}


def _usage() -> str:
    lines = ["usage: zeroedu <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "`zeroedu <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"zeroedu: unknown command '{name}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Print the resolved versions of moe-lab's stack, one line each, and where they differ from constraints.txt
(the set CI last ran the suite on). Run by .ci/run right after the install: drift shows in the first CI log."""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata
from pathlib import Path

STACK = ("torch", "transformers", "lightning", "peft", "deepspeed", "lm-eval", "hydra-core", "datasets", "wandb")
CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of a constraints file (comments skipped)."""
    if not path.is_file():
        return {}
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[canonical(name)] = version.strip()
    return pins


def installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(pins: dict[str, str]) -> list[str]:
    """One line per package: name, installed version, and the constraints.txt version where it differs."""
    lines = [f"{'python':<13} {platform.python_version()}"]
    for name in STACK:
        version = installed(name)
        want = pins.get(canonical(name))
        differs = want is not None and version.split("+")[0] != want
        lines.append(f"{name:<13} {version}" + (f"   (constraints.txt: {want})" if differs else ""))
    return lines


if __name__ == "__main__":
    pins = pinned()
    lines = report(pins)
    print("resolved stack (constraints.txt: the set the suite last passed on):")
    print("\n".join("  " + line for line in lines))
    drift = [line.split()[0] for line in lines if "constraints.txt:" in line]
    if drift:
        print(f"  drift from constraints.txt: {', '.join(drift)}", file=sys.stderr)

"""What moved: each installed package whose version differs from constraints.txt, and those new
or gone (DISTLAB_NEWEST=1 bash .ci/run prints it before testing the newest allowed versions)."""
from __future__ import annotations

import re
import subprocess
import sys


def versions(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
        if match:
            pins[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2].split("+")[0]
    return pins


def main(constraints: str) -> None:
    with open(constraints) as handle:
        pinned = versions(handle)
    installed = versions(subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True,
                                        check=True).stdout.splitlines())
    moved = [f"  {name}: {pinned[name]} -> {installed[name]}" for name in sorted(pinned)
             if name in installed and installed[name] != pinned[name]]
    new = [f"  {name}: new, {installed[name]}" for name in sorted(set(installed) - set(pinned))]
    gone = [f"  {name}: pinned {pinned[name]}, not installed" for name in sorted(set(pinned) - set(installed))]
    print(f"versions against {constraints}: {len(moved)} moved, {len(new)} new, {len(gone)} gone")
    print("\n".join(moved + new + gone) or "  none")


if __name__ == "__main__":
    main(sys.argv[1])

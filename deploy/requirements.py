"""Print the service's requirements from pyproject.toml, one per line, for `pip install -r`.

    python deploy/requirements.py [EXTRA ...]

The image installs the dependencies before it copies the code, so a code change does not
reinstall them; pyproject.toml stays the one list. An extra that pyproject.toml does not
declare is an error (pip would only warn and install the image without it).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in declared]
    if unknown:
        raise SystemExit(f"pyproject.toml declares no extra {', '.join(unknown)} "
                         f"(it has: {', '.join(declared)})")
    return [*project["dependencies"], *(req for extra in extras for req in declared[extra])]


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    extras = [e for arg in sys.argv[1:] for e in arg.replace(",", " ").split()]
    print("\n".join(requirements(root / "pyproject.toml", extras)))

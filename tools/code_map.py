"""The shape of the code base, printed by ``make lint``: the folder of hpctp/ holding the largest share of the
library's lines directly (it fails above MAX_SHARE: a room that large wants splitting by concern), and the user
guide's page count (docs/guide/, one file per page)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_SHARE = 0.20
"""The most of hpctp's lines one folder may hold directly (files in it, not in its sub-folders)."""


def folder_lines(package: Path) -> dict[str, int]:
    """Lines of the ``.py`` files directly in each folder of ``package`` (by path relative to the repository)."""
    out: dict[str, int] = {}
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        n = sum(len(f.read_text(errors="ignore").splitlines()) for f in folder.glob("*.py"))
        if n:
            out[str(folder.relative_to(ROOT))] = n
    return out


def main() -> int:
    lines = folder_lines(ROOT / "hpctp")
    total = sum(lines.values())
    folder, most = max(lines.items(), key=lambda kv: kv[1])
    pages = sorted(p.stem for p in (ROOT / "docs" / "guide").glob("*.rst") if p.stem != "index")
    print(f"code map: {total} lines in hpctp/; the largest folder, {folder}/, holds {most} ({most / total:.0%}; "
          f"at most {MAX_SHARE:.0%}); the user guide has {len(pages)} pages ({', '.join(pages)})")  # fmt: skip
    if most / total > MAX_SHARE:
        print(f"code map: {folder}/ holds more than {MAX_SHARE:.0%} of the library: split it into rooms by concern")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

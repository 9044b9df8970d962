"""Golden generated code: `python -m mirage_cli.codegen.golden` writes, for every
``examples/**/*.mir``, ``golden/<same path>.cu`` and ``.h`` (what ``mirage codegen``
emits at the program's default parameters). Run from the repository root; review the
diff before committing."""

from __future__ import annotations

from pathlib import Path

from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.loading import load_graph
from mirage_cli.util import write_atomic


def golden_paths(example: Path) -> tuple[Path, Path]:
    root = example.resolve().parent
    while root.name != "examples":
        root = root.parent
    rel = example.resolve().relative_to(root)
    base = root.parent / "golden" / rel.with_suffix("")
    return base.with_suffix(".cu"), base.with_suffix(".h")


def main() -> None:
    for path in sorted(Path("examples").rglob("*.mir")):
        cu, h = emit(lower(load_graph(str(path))))
        cu_path, h_path = golden_paths(path)
        write_atomic(cu_path, cu)
        write_atomic(h_path, h)
        print(f"wrote {cu_path} and {h_path}")


if __name__ == "__main__":
    main()

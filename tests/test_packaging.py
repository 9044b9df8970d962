"""The installed distribution carries every subpackage and data file the source has.

`pip install .` (non-editable) installs only the packages pyproject.toml lists, so a
new subpackage that is not listed works in a checkout and breaks when installed.
"""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def test_every_subpackage_is_listed_in_pyproject():
    # Any folder holding Python source, with or without __init__.py (a namespace
    # package imports from a checkout but is left out of a wheel unless listed).
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "mirage_cli").rglob("*.py")
             if "__pycache__" not in p.parts}
    missing = found - _listed_packages()
    assert not missing, f"add to [tool.setuptools] packages: {sorted(missing)}"


def test_grammar_ships_with_the_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["package-dir"]["mirage_cli.grammar"] == "grammar"
    assert "*.lark" in config["tool"]["setuptools"]["package-data"]["mirage_cli.grammar"]
    assert (ROOT / "grammar" / "mir.lark").is_file()

"""Jinja2 templates of the generated CUDA (one cached environment, StrictUndefined)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent)),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        trim_blocks=True, lstrip_blocks=True, autoescape=False)


def render(template: str, **values: Any) -> str:
    return environment().get_template(template).render(**values)


@functools.cache
def raw(name: str) -> str:
    """A file of this directory used verbatim (CUDA that is not a template)."""
    return (Path(__file__).parent / name).read_text(encoding="utf-8")

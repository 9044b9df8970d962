"""Write the example programs at decode shapes they do not use, for a bench of the
generator on sizes it was not tuned on. No GPU needed.

    PYTHONPATH=$PWD python tools/decode_shapes.py DIR
    mirage bench --gpu 0 --root DIR --batch own --top 1

Each program is one of ``examples/{rmsnorm_linear,gated_mlp,lora,ntrans}.mir`` with its
sizes set in its header (hidden sizes 2048-8192, widths up to 18944, batch 1-32, from
Llama-3.2-1B/3B, Mistral-7B, Phi-3, Qwen2/2.5, Gemma-2 and Llama-3-70B layers), named
after them (``rmsnorm_linear_h3072_n5120_b4.mir``), so that `mirage bench --root DIR
--batch own` times each at its own sizes. Widths with odd factors (3840, 4608, 5120,
6912, 13824, 18944) are the point: their tilings cannot all fill the 132 SMs with
128-byte rows of the weight. The list is fixed, so runs compare.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES: list[tuple[str, dict[str, int]]] = [
    ("rmsnorm_linear", {"hidden": 2048, "n": 3072, "batch": 1}),
    ("rmsnorm_linear", {"hidden": 3072, "n": 5120, "batch": 4}),
    ("rmsnorm_linear", {"hidden": 5120, "n": 7168, "batch": 16}),
    ("rmsnorm_linear", {"hidden": 8192, "n": 10240, "batch": 1}),
    ("rmsnorm_linear", {"hidden": 3072, "n": 9216, "batch": 32}),
    ("rmsnorm_linear", {"hidden": 3584, "n": 4608, "batch": 2}),
    ("rmsnorm_linear", {"hidden": 2560, "n": 3840, "batch": 8}),
    ("gated_mlp", {"hidden": 2048, "n": 8192, "batch": 1}),
    ("gated_mlp", {"hidden": 3072, "n": 8192, "batch": 16}),
    ("gated_mlp", {"hidden": 5120, "n": 13824, "batch": 4}),
    ("gated_mlp", {"hidden": 3584, "n": 18944, "batch": 32}),
    ("gated_mlp", {"hidden": 4096, "n": 14336, "batch": 2}),
    ("gated_mlp", {"hidden": 2560, "n": 6912, "batch": 8}),
    ("lora", {"hidden": 4096, "n": 4096, "rank": 16, "batch": 1}),
    ("lora", {"hidden": 3584, "n": 4608, "rank": 64, "batch": 16}),
    ("lora", {"hidden": 2048, "n": 8192, "rank": 8, "batch": 32}),
    ("ntrans", {"hidden": 2048, "batch": 1}),
    ("ntrans", {"hidden": 5120, "batch": 4}),
    ("ntrans", {"hidden": 3584, "batch": 32}),
]

HEADER = re.compile(r"program (\w+)\(([^)]*)\)")


def program_text(example: str, sizes: dict[str, int]) -> tuple[str, str]:
    """(name, text): ``examples/EXAMPLE.mir`` with ``sizes`` as its header's defaults."""
    text = (ROOT / "examples" / f"{example}.mir").read_text()
    m = HEADER.search(text)
    if m is None:
        raise SystemExit(f"examples/{example}.mir: no program header")
    params = dict(p.strip().split(" = ") for p in m.group(2).split(","))
    unknown = set(sizes) - set(params)
    if unknown:
        raise SystemExit(f"examples/{example}.mir has no parameter {min(unknown)}")
    params.update({k: str(v) for k, v in sizes.items()})
    name = example + "_" + "_".join(f"{k[0]}{v}" for k, v in sizes.items())
    header = f"program {name}(" + ", ".join(f"{k} = {v}" for k, v in params.items()) + ")"
    return name, text[:m.start()] + header + text[m.end():]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/decode_shapes.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for example, sizes in SHAPES:
        name, text = program_text(example, sizes)
        (out / f"{name}.mir").write_text(text)
        print(out / f"{name}.mir")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

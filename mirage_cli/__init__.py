"""mirage-cli: a command-line superoptimizer for tensor programs on NVIDIA GPUs.

Pipeline (DESIGN.md §2): `.mir` --parse--> `.ugraph.json` --search--> candidates
--verify--> --optimize--> best µGraph --codegen--> `.cu` + `.h` --compile--> `.cubin`.
"""

__version__ = "0.1.0"

"""µGraph search: enumerate kernel and block graphs equivalent to a program.

One module per concern:
- :mod:`.abstract`  abstract expressions (terms) and the per-operator rule library the
  operator registry references (slots ``abstract`` and ``decompose``);
- :mod:`.indices`   index labels of tensor dimensions (which dims a grid/forloop splits);
- :mod:`.prune`     the Z3 oracle: subexpression and equivalence queries, cached;
- :mod:`.enumerate` the generator: designs (kernels, block operators, maps) and their
  tunings (grid sizes, forloop ranges);
- :mod:`.cost`      the first cost model ranking candidates;
- :mod:`.verify`    the one function through which every candidate is verified;
- :mod:`.cache`     the on-disk result cache;
- :mod:`.driver`    options, budget, worker processes, progress, ranking.
"""

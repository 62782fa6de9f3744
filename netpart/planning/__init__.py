"""Planning a cluster and presenting plans: how should M machines be spent, and what does a
plan look like?

`plan --machines` (every split of M machines into replicas x workers + shards, and
all-reduce, priced with one cost model), sweeps over worker counts, the plan report and its
pictures.
"""

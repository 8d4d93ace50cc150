"""What the tests and the benchmarks share: a simulated rank that loads no model
(:mod:`.sim_rank`), the synthetic workloads of the driver's benchmarks (:mod:`.workload`) and
how a timeline of rank calls splits a replica's time (:mod:`.timeline`). The tests import
nothing from ``benchmarks/``; the benchmarks import these.
"""

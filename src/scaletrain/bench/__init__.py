"""Benchmarks of the machine at hand, measured, never estimated.

    scaletrain bench comms --nproc N       collectives: median time, algorithm and bus bandwidth
    scaletrain bench step --config FILE    one config's step: time, tokens/s, MFU, peak memory,
                                           with --vs variants (and a hand-written loop) beside it
    scaletrain bench techniques --config   what each technique buys in speed and in memory

Comparisons run in one process (or one group of ranks), interleaved: one step of each runner
per round, the order rotated every round, so a noisy machine slows every runner alike and the
ratios stay fair (`interleave.py`). `comms.py` writes the bus bandwidth the planner can use
(`scaletrain plan --comms FILE`).
"""

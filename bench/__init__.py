"""Benchmarks of :mod:`ckpt` that report ratios measured in one run.

``python -m bench [--quick] [--only GROUP,...] [--json OUT]``: every metric is ours divided by a
baseline (torch DCP, ``dd``, a same-world load, the state size) measured in the
same run, on the same files and ranks, interleaved, so that a noisy machine moves
both sides together. See BENCHMARKS.md for what each metric means.
"""

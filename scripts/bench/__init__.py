"""The pieces of ``scripts/bench_schedules.py``, one concept each, imported in this order:

workloads   timed layers that sleep their costs; p2p latency and sleep overshoot here
cases       which runtimes run which schedule on which workload; the ideal step
results     typed records: per rank while measuring, per table row when reporting
runners     every rank builds a case's runs and steps them in turn (pipeline.launch)
report      medians, efficiencies and the simulator's prediction -> the two tables
traces      --trace: Chrome traces of ours, measured next to simulated, and overheads
"""

__all__: list[str] = []

"""``scripts/bench_autoplan.py`` in parts: ``plans`` (grid, limits, cases), ``measure`` (the ranks' rounds)
and ``report`` (rows, table, detail). Import them with ``scripts/`` on the path, as the script does."""

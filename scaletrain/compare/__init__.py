"""The commands that train several runs side by side and compare them: `scaletrain parity` (layouts against the
single-process run, parity.py) and `scaletrain bench` (config switches against the plain run, bench.py), over one
way of starting a training run as a subprocess (run/child.py)."""

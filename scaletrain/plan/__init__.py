"""The planner's commands: `scaletrain plan` (the search, one layout's estimate), `train --dry-run`,
`parallel.auto` (commands.py) and `plan --calibrate` (calibrate.py on a CPU, calibrate_gpu.py on a GPU host). The
estimators they call (memory, time, hardware, search) are in scaletrain/planner/, which imports none of these."""

"""Planning a layout. The model is estimators/: what each rank holds (memory), how long a step takes (time), on
which device (hardware), and the best layout (search); it imports nothing of the commands. The commands use it here:
`scaletrain plan` (the search, one layout's estimate), `train --dry-run` and `parallel.auto` (commands.py), and
`plan --calibrate` (calibrate.py on a CPU, calibrate_gpu.py on a GPU host, measure.py their timings)."""

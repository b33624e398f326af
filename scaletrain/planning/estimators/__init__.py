"""The planner's model: what each rank holds (memory), how long a step takes (time), on which device (hardware),
and the best layout (search); docs/planner.md states it. Its commands (`plan`, `--dry-run`, `parallel.auto`,
`--calibrate`) are one folder up, in scaletrain/planning/, and this folder imports none of them."""

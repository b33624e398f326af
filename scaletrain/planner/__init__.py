"""The planner's estimators: what each rank holds (memory), how long a step takes (time), on which device
(hardware), and the best layout (search); docs/planner.md states the model. Its commands (`plan`, `--dry-run`,
`parallel.auto`, `--calibrate`) are in scaletrain/plan/."""

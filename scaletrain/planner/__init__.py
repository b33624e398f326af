"""Planning a run before it starts: what each rank holds (memory), how long a step takes (time), on which device
(hardware, calibrate), and the best layout (search); docs/planner.md states the model."""

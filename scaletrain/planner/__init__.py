"""Planning a run before it starts: what each rank will hold (memory.per_rank_bytes) and whether it fits."""

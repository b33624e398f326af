"""A run on disk: the run directory and everything in it (directory.py: RunDir, open_run_dir, the run a command
without --run.dir continues) and the rules for continuing a run (resume.py: what a resume may and may not change)."""

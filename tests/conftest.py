import os

# Tests run on a 2-core machine beside other processes: keep each one to a single thread unless it says otherwise,
# and keep tokenised data in a per-session cache so a test never depends on the user's ~/.cache.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

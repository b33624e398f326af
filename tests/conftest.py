import os
from pathlib import Path

# Tests run on a 2-core machine beside other processes: one thread each unless a test says otherwise. Tokenised
# data and the measured CPU peak go to a cache inside the checkout, shared by the tests of one run and never by the
# user's ~/.cache.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SCALETRAIN_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "tests"))

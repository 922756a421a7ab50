import os

# Keep each test process to the 2 cores CI has, and make worker subprocesses do the same.
os.environ.setdefault("OMP_NUM_THREADS", "2")

"""`make soak` sets PIPECORE_SOAK=1: tests whose whole search is longer than the suite can afford run it
then, and a fixed part of it in `make test` (each test says which part)."""

import os

SOAK = os.environ.get("PIPECORE_SOAK") == "1"

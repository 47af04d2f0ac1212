"""pipecore's version (setup.py reads it from here)."""

__version__ = "0.1.0"

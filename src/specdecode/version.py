"""The package's version: pyproject reads it, ``specdecode --version`` prints it, bench reports and trained heads
record it."""

__version__ = "0.1.0"

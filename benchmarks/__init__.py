"""The maintained measurement scripts (run each as ``python benchmarks/NAME.py --help``); a package so that the tests
import the ones they check (``from benchmarks import prefix_cache``)."""

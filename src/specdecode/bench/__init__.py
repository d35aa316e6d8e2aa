"""`specdecode bench`: workloads, methods compared in one process, metrics, report and plots."""

from .methods import MethodSpec, build_methods
from .metrics import TurnRecord, aggregate
from .runner import BenchConfig, BenchResult, run_bench
from .workloads import SUBTASKS, WorkItem, default_items, load_items, select_items, subtask_of

__all__ = [
    "SUBTASKS",
    "BenchConfig",
    "BenchResult",
    "MethodSpec",
    "TurnRecord",
    "WorkItem",
    "aggregate",
    "build_methods",
    "default_items",
    "load_items",
    "run_bench",
    "select_items",
    "subtask_of",
]

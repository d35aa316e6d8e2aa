"""The library loads no training code: ``import specdecode`` and the inference-only ``heads`` package never import
``specdecode.training`` (checked in a fresh interpreter, and in heads/'s source for imports inside functions too),
and the CLI loads its training commands' modules only when one runs."""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import specdecode.heads

PROBE = """
import importlib, json, pkgutil, sys

def training():
    return sorted(m for m in sys.modules if m == "specdecode.training" or m.startswith("specdecode.training."))

import specdecode
seen = {"specdecode": training()}
import specdecode.heads
for info in pkgutil.iter_modules(specdecode.heads.__path__):
    importlib.import_module("specdecode.heads." + info.name)
seen["specdecode.heads"] = training()
import specdecode.cli
seen["specdecode.cli"] = training()
print(json.dumps(seen))
"""


def test_import_specdecode_and_heads_load_no_training_module():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["specdecode"] == []
    assert seen["specdecode.heads"] == []
    # the CLI reads only the data split's constant (HELD_OUT, an option's default) from the stdlib-only data module
    assert set(seen["specdecode.cli"]) <= {"specdecode.training", "specdecode.training.data"}


def test_heads_source_never_imports_training():
    folder = Path(specdecode.heads.__file__).parent
    offenders = []
    for info in pkgutil.iter_modules([str(folder)]):
        path = folder / f"{info.name}.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                names = [base, *(base + ("" if base.endswith(".") else ".") + alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(n.startswith(("..training", "specdecode.training")) for n in names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []

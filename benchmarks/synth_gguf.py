#!/usr/bin/env python3
"""Write a GGUF with random weights in a real model's shape and the bundled SmolLM2's tokenizer
(specdecode.bench.synthetic): a stand-in for timing and memory next to llama.cpp on the same file. The text it
writes is noise; acceptance cannot be measured on it.

Usage: .venv/bin/python benchmarks/synth_gguf.py OUT.gguf SHAPE [SOURCE.gguf]
(SHAPE: 360m | 1.7b | 8b; SOURCE: the bundled SmolLM2 by default, for its tokenizer.) Generated, never committed:
benchmarks/load_cost.py measures load, memory and speed on the result; ``specdecode bench --synthetic SHAPES`` writes
the files into the cache and measures them in one go."""

import sys
from pathlib import Path

from specdecode.bench.synthetic import SHAPES, write_synthetic_gguf

if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[2] not in SHAPES:
        sys.exit(__doc__)
    source = Path(sys.argv[3]) if len(sys.argv) == 4 else None
    write_synthetic_gguf(Path(sys.argv[1]), SHAPES[sys.argv[2]], source)

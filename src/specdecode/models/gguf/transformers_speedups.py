"""transformers' own GGUF loading, made faster without changing what it reads.

A model's first load builds its dense copy (``conversions.dense_cache``) through transformers' GGUF path, which parses
the file with gguf's ``GGUFReader`` three times (for the config, for the tokenizer's config and for the weights)
and builds gguf's tensor-name map once per module (~400 of them). The reader makes a numpy view per metadata
element, two per string, each a ``np.memmap``, whose ``__getitem__`` and ``__array_finalize__`` cost more than the
view itself: for Gemma 3's 262,144-token vocabulary ~30 s a parse on a 2-core Zen 3. Inside
``faster_transformers_gguf()``:

- gguf's reader runs over a plain ``ndarray`` view of the same memory map (``PlainViewReader``): the same fields
  and tensors, value for value, without the memmap subclass on each view;
- each file is parsed once for the whole block (transformers opens it read-only and never changes the reader);
- gguf's tensor-name map is built once per (architecture, layer count).

transformers imports ``GGUFReader`` and ``get_tensor_name_map`` from gguf at each call, so the swap is of gguf's
module attributes, restored on leaving the block (one block at a time in a process).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import gguf
import numpy as np

_lock = threading.RLock()


class PlainViewReader(gguf.GGUFReader):
    """gguf's reader, its memory map held as a plain ndarray view: every field part and tensor is a plain view of the
    same bytes (gguf slices ``self.data`` for each of them)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


@contextlib.contextmanager
def faster_transformers_gguf() -> Iterator[None]:
    """Within the block, gguf's ``GGUFReader`` is a ``PlainViewReader`` shared per (path, mode) and its
    ``get_tensor_name_map`` is cached; both are restored on exit, also on an error."""
    with _lock:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], PlainViewReader] = {}

        def shared_reader(path, mode="r"):
            key = (str(path), mode)
            if key not in readers:
                readers[key] = PlainViewReader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map

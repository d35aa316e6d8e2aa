"""GGUF files: the tensor index (``index``), the blocks read as stored (``file_blocks``), the config transformers'
reader leaves out (``config``), the first-use conversions cached on disk (``conversions``) and transformers' own
GGUF reading made faster (``transformers_speedups``)."""

"""Weight formats, each a callable ``x -> x @ W.T``: dense, int8 and int4 on PyTorch's kernels (``weights``), integer
blocks as a GGUF file stores them (``blocks``) and the compiled kernels' tiles (``kernel_linear``)."""

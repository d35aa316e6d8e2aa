"""The native runner (Llama, Qwen 2/3 and Gemma 3 families): the runner (``runner``), its KV cache (``kv_cache``), its
plain-PyTorch and compiled-kernel paths (``torch_path``, ``kernel_path``), the fused layers it reads (``layers``) and
what each family asks of it (``architecture``)."""

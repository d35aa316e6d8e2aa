"""``load_model``: a bundled name (``bundled``), an HF folder (``checkpoint``: safetensors read a tensor at a time), a
.gguf file or a built model, resolved (``sources``), planned before any weight is read (``plan``), filled and
quantized (``quantize``) by ``loader``."""

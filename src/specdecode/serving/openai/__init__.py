"""OpenAI's wire format: request bodies (``protocol``), responses and stream chunks (``responses``), per-token extras
(``tokens``), ``tools`` (``tools``) and ``response_format`` (``response_format``)."""

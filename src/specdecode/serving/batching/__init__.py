"""The engine thread: continuous batching of requests over one target (``scheduler``), the speculate-or-not policy
(``policy``) and the prefix cache of KV rows (``prefix_cache``)."""

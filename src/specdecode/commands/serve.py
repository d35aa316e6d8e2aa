"""``specdecode serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn), or replicas on Ray Serve."""

from __future__ import annotations

import os

import typer

from specdecode.commands import (
    DtypeOption,
    GroupSizeOption,
    HeadsOption,
    ProposerChoice,
    QuantizationOption,
    err,
    parse_gamma,
    parse_quantization,
    quiet_transformers,
)


def serve(
    target: str = typer.Option("smollm2", help="Target model: a bundled name, an HF folder or a .gguf file."),
    proposer: ProposerChoice | None = typer.Option(
        None, help="Default proposer (as generate's; draft needs --draft). Default: draft with --draft, else lookup."
    ),
    draft: str | None = typer.Option(
        None, help="Draft model (HF folder or .gguf), self:N (the target's N layers) or skip:SKIP.json."
    ),
    gamma: str = typer.Option("auto", help="Most tokens drafted per round, or auto (the policy picks, up to 8)."),
    policy: str = typer.Option(
        "auto", help="auto (speculate while the measured costs say it pays at this batch size), always or never."
    ),
    mode: str = typer.Option(
        "reproducible", help="reproducible (a seed gives the same text under any load) or exact (min(1, p/q) rule)."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default; 0.0.0.0 for all)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    max_batch: int = typer.Option(16, help="Most requests decoded at once (each holds a KV cache); more wait."),
    max_context: int | None = typer.Option(
        None,
        min=1,
        help="Most tokens a request may hold, prompt and output together (default: 4096, or the model's context "
        "window if shorter); a longer request is refused. The server starts only if the weights and --max-batch "
        "KV caches of this many tokens fit the memory available (checked before the weights are read).",
    ),
    api_key: str | None = typer.Option(
        None, envvar="SPECDECODE_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health."
    ),
    max_body_bytes: int = typer.Option(1_000_000, help="Largest request body accepted (413 above)."),
    served_model_name: str | None = typer.Option(None, help="Model id clients use (default: the target's name)."),
    ray: bool = typer.Option(False, "--ray", help="Run replicas on Ray Serve (pip install 'specdecode\\[ray]')."),
    replicas: int = typer.Option(1, help="With --ray: replicas of the whole app (each loads the model)."),
    threads: int | None = typer.Option(None, help="Torch threads per server or replica (default: torch's choice)."),
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    suffix_cache: str | None = typer.Option(
        None,
        help="--proposer suffix or eagle+suffix: a history file (from `specdecode index` or an earlier run) loaded "
        "at start; with --suffix-scope global the server writes its history back to it at shutdown.",
    ),
    suffix_scope: str = typer.Option(
        "global",
        help="--proposer suffix or eagle+suffix: global (drafts from every earlier request's prompt and answer) or "
        "request (from the request's own tokens and --suffix-cache only: no timing hints about other users' text).",
    ),
    heads: HeadsOption = None,
    prefix_cache_gb: float | None = typer.Option(
        None,
        help="GiB of KV rows kept from earlier requests, reused by prompts that share their prefix (0: off). "
        "Default: a quarter of the memory available after --max-batch full-context caches, at most 8.",
    ),
) -> None:
    """Serve TARGET over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /metrics."""
    from specdecode.serving.app import ServerConfig

    parse_quantization(quantization)
    choice = proposer or (ProposerChoice.draft if draft else ProposerChoice.lookup)
    config = ServerConfig(
        target=target,
        proposer=choice.value,
        draft=draft,
        gamma=parse_gamma(gamma),
        policy=policy,
        mode=mode,
        max_batch=max_batch,
        max_context=max_context,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        served_model_name=served_model_name,
        dtype=dtype,
        quantization=quantization,
        group_size=group_size,
        threads=threads,
        suffix_cache=suffix_cache,
        suffix_scope=suffix_scope,
        heads=heads,
        prefix_cache_gb=prefix_cache_gb,
    )
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        err.print(f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who can reach it may use it")
    if ray:
        from specdecode.serving.ray_app import run

        run(config, replicas=replicas, host=host, port=port)
        return
    if replicas != 1:
        raise ValueError("--replicas needs --ray (one process serves one replica)")
    _serve_here(config, host, port)


def _serve_here(config, host: str, port: int) -> None:
    import uvicorn

    from specdecode.serving.app import Server, create_app

    quiet_transformers()
    with err.status(f"loading {config.target}…"):
        server = Server(config)  # load before binding: a bad model or option is one line, not a traceback
    err.print(
        f"[dim]serving {server.model_name} on http://{host}:{port} (proposer {config.proposer}, gamma "
        f"{config.gamma}, policy {config.policy}, max batch {config.max_batch} × {server.window} tokens, pid "
        f"{os.getpid()})[/dim]",
        highlight=False,
    )
    uvicorn.run(create_app(server), host=host, port=port, log_level="info", timeout_graceful_shutdown=5)

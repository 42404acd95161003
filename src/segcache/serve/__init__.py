"""`segcache serve`: an OpenAI- and Anthropic-compatible HTTP server on segcache runtimes and the prefix store.

    cli.py        the command line: flags, loading, the store, uvicorn, shutdown
    app.py        the Starlette app: routes, auth, CORS, body limit, SSE
    guard.py      connections (timeouts, a limit), Host / Origin / Content-Type checks, 500s, log floods
    pipeline.py   the chat surfaces' one pipeline: a ChatTurn rendered, queued, its events relayed
    output.py     the output split into reasoning, text and tool calls (mlx-lm's parsers)
    shapes.py     OpenAI's completions and chat completions: turns in, response bodies out
    responses.py  OpenAI's Responses API (stateless)
    anthropic.py  Anthropic's Messages API and count_tokens
    schemas.py    pydantic request models, the field policy, validation into 4xx errors
    errors.py     `APIError`: an OpenAI-style error body with its status
    chat.py       prompts: chat templates (or the plain one), tools, message boundaries
    text.py       stop strings held back across streamed text segments
    engine.py     the request engine: every request a row of one decoder, resumed, generated, published
    worker.py     the Scheduler (bounded FIFO queue, step()) and its model thread

The HTTP event loop never touches MLX: requests reach the one model worker
through the scheduler's queue and its events come back through the loop's
`call_soon_threadsafe`. docs/serve.md describes the whole design.
"""

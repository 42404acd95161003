"""`segcache serve`: an OpenAI-compatible HTTP server on segcache runtimes and the prefix store.

    cli.py      the command line: flags, loading, the store, uvicorn, shutdown
    app.py      the Starlette app: routes, auth, CORS, body limit, SSE
    guard.py    connections (timeouts, a limit), Host / Origin / Content-Type checks, 500s, log floods
    shapes.py   response bodies in OpenAI's shapes
    schemas.py  pydantic request models and their validation into 4xx errors
    errors.py   `APIError`: an OpenAI-style error body with its status
    chat.py     prompts: chat templates (or the plain one) and message boundaries
    text.py     stop strings held back across streamed text segments
    engine.py   the request engine: every request a row of one decoder, resumed, generated, published
    worker.py   the Scheduler (bounded FIFO queue, step()) and its model thread

The HTTP event loop never touches MLX: requests reach the one model worker
through the scheduler's queue and its events come back through the loop's
`call_soon_threadsafe`. docs/serve.md describes the whole design.
"""

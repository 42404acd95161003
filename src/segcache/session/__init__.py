"""One request's life, once: resume and prefill, join the decoder, steps, settle, release, publish.

    prefill.py   Prefill: a prompt's resume from the prefix store and its feeding on one
                 runtime; the one caller of the prefix-cache protocol outside store/
                 (Runtime.prefill / prefill_steps / publish delegate to it)
    hidden.py    Hidden: an MTP drafter's hidden states of the forwards a prefill ran
    session.py   Session: a request's prompt (target and draft) and its rows on a
                 BatchDecoder, with one end-of-sequence rule; Progress

`stream_generate` (generation.py) runs one Session; the server's engine
(serve/engine.py) one per request. This file imports nothing, so `runtime.py`
can use prefill.py without loading the rest (which is above it).
"""

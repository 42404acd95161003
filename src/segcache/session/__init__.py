"""One request's life, once: resume and prefill, join the decoder, steps, settle, release, publish.

    session.py   Session: a request's prompt (target and draft) and its rows on a
                 BatchDecoder, with one end-of-sequence rule; Progress
    hidden.py    Hidden: an MTP drafter's hidden states of the forwards a prefill ran

The prefill plan a session runs (resume from the prefix store, restore, agree across
ranks, checkpoints, publish) is `segcache/prefill.py`, a floor below `runtime.py`
(whose `prefill` / `prefill_steps` / `publish` delegate to it): the one caller of the
prefix-cache protocol outside `store/`. `stream_generate` (generation.py) runs one
Session; the server's engine (serve/engine.py) one per request.
"""

"""Public testing helpers: tiny models, hypothesis strategies, the runtime state machine."""

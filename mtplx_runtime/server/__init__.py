"""OpenAI-compatible HTTP serving (`mtplx serve`): `engine` (one worker thread owns the model),
`params` (request validation), `app` (ASGI routes), `metrics` (Prometheus text), `conn` (the
h11 protocol: read deadlines, connection cap), `access` (the access log)."""

"""OpenAI-compatible HTTP serving (`mtplx serve`): `engine` (one worker thread owns the model),
`params` (request validation), `app` (ASGI routes), `metrics` (Prometheus text), `cli`."""

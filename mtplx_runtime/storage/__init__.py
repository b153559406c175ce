"""Where expert bytes live: banks (one part file per routed layer), the manifest, the builder,
verification and the readers (FORMAT.md "Streaming artifact")."""

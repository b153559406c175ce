"""The Kimi K3 text model: reference blocks (FORMAT.md "Model") and the whole-model forward."""

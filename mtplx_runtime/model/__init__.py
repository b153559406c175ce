"""The Kimi K3 text model: reference blocks (k3-model.md §4) and the whole-model forward."""

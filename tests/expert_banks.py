"""Random expert banks for the kernel tests: every backend is checked on the same kind of bank."""

from types import SimpleNamespace

import numpy as np

from mtplx_runtime.formats.record import PROJECTIONS, record_bytes, record_layout


def make_bank(mode, bits, R, I, E, seed=0, scale=0.3, group=None):  # noqa: E741 (the legend's)
    """(layout, store uint8 [E, record bytes] with expert e in slot E-1-e): records of `mode` /
    `bits` / `group` (None: the mode's default) for experts of latent R and width I, weights
    N(0, scale²) encoded by the mode's codec. The reversed slot order makes a test that confuses
    expert ids with slots fail."""
    shapes = {"gate": (I, R), "up": (I, R), "down": (R, I)}
    layout = record_layout(SimpleNamespace(expert_shapes=shapes), mode, bits, group)
    rng = np.random.default_rng(seed)
    store = np.zeros((E, layout.logical_bytes), dtype=np.uint8)
    for e in range(E):
        parts = {p: layout.codec.encode(rng.standard_normal(shapes[p]).astype(np.float32) * scale)
                 for p in PROJECTIONS}
        store[E - 1 - e] = np.frombuffer(record_bytes(layout, parts), np.uint8)
    return layout, store

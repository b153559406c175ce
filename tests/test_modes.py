"""The codec table (formats/modes.py) is the one list of codec facts: every consumer that once
kept its own list (get_codec, the record layout, the manifest's mode rule, the native CPU
library and its C enum, the cpu backend's native modes, the memory plan, the profiler, the CUDA
kernel table) agrees with it, and so does FORMAT.md "Bank parts"."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from mtplx_runtime import formats
from mtplx_runtime.engine.plan import decodes_experts
from mtplx_runtime.formats import modes
from mtplx_runtime.formats.modes import MODES, ROWS, mode_codec, quantization_for
from mtplx_runtime.formats.record import PROJECTIONS, record_layout
from mtplx_runtime.kernels import cpu, cpu_native, cuda
from mtplx_runtime.profile import replay

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"gate": (128, 256), "up": (128, 256), "down": (256, 128)}
READABLE = [(m.name, b, g) for m in MODES.values() if m.codec for b in m.bits for g in m.groups]


def test_rows_are_unique_and_codecs_load():
    assert len({m.name for m in ROWS}) == len(ROWS)
    assert formats.CODEC_NAMES == tuple(dict.fromkeys(m.codec for m in ROWS if m.codec))
    for name in formats.CODEC_NAMES:
        assert formats.get_codec(name).name == name
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        formats.get_codec("nope")
    assert "q2k" in formats.CODEC_NAMES and "q2k" not in MODES  # a source, never a bank


@pytest.mark.parametrize("mode,bits,group", READABLE)
def test_mode_codec_components_are_the_rows_parts(mode, bits, group):
    row = MODES[mode]
    codec = mode_codec(mode, bits, group)
    assert codec.name == row.codec and getattr(codec, "group_size", group) == group
    for shape in SHAPES.values():
        assert tuple(c.name for c in codec.components(shape)) == row.parts
    layout = record_layout(SimpleNamespace(expert_shapes=SHAPES), mode, bits, group)
    assert tuple(s.component for s in layout.segments if s.proj) == row.names()
    assert row.names()[0].startswith(f"{PROJECTIONS[0]}_proj.")
    assert repr(layout.codec) == repr(codec) and row.allows(bits, group)
    assert quantization_for(mode, bits, group) == {"bits": bits, "group_size": group,
                                                   "mode": mode}


def test_mode_codec_rejects_what_the_table_does_not_hold():
    with pytest.raises(formats.FormatError, match="unknown codec mode 'q2k'"):
        mode_codec("q2k")
    with pytest.raises(formats.FormatError, match="no codec reads it"):
        mode_codec("affine", 4)
    with pytest.raises(formats.FormatError, match="bits must be one of"):
        mode_codec("ct-int", None)
    with pytest.raises(formats.FormatError, match="bits must be one of"):
        mode_codec("t158", 3)
    with pytest.raises(formats.FormatError, match="group_size must be one of"):
        mode_codec("ct-int", 4, 128)
    assert not MODES["ct-int"].allows(4, 128) and MODES["affine"].allows(2, 7)
    assert mode_codec("t158", 2).name == mode_codec("t158").name == "t158"


def test_native_cpu_library_follows_the_cpu_column():
    want = tuple(dict.fromkeys(m.cpu for m in ROWS if m.cpu))
    assert cpu_native.CODECS == want
    assert set(cpu_native._FROM_PARTS) == set(want)
    assert cpu.NATIVE_MODES == {m.name for m in MODES.values() if m.cpu}
    if cpu_native.unavailable_reason() is None:  # the C enum, by name, in order
        lib = cpu_native._load()
        assert [lib.mtplx_cpu_codec_name(i) for i in range(len(want) + 1)] == \
            [c.encode() for c in want] + [None]
    for m in MODES.values():
        assert decodes_experts("cpu", m.name) == (m.cpu is None)
        assert decodes_experts("reference", m.name)


def test_cuda_kernels_follow_the_cuda_column():
    assert cuda.KERNELS == modes.cuda_kernels()
    for m in MODES.values():
        if m.cuda:
            assert cuda.COMPONENTS[m.name] == m.parts[:2]


def _cuda_runs(mode, bits, group):
    return any(k.bits in (None, bits) and (k.group or MODES[mode].group_size) == group
               for k in MODES[mode].cuda)


@pytest.mark.parametrize("mode,bits,group", READABLE)
def test_cuda_refuses_what_the_cuda_column_does_not_run(mode, bits, group):
    layout = record_layout(SimpleNamespace(expert_shapes=SHAPES), mode, bits, group)
    assert (cuda.unsupported(layout) is None) == _cuda_runs(mode, bits, group)
    # what `mtplx plan` says of a GPU plan, from the manifest's quantization alone
    assert (modes.cuda_gap(mode, bits, group) is None) == _cuda_runs(mode, bits, group)


def test_profiler_codec_names_follow_the_table():
    assert replay.CODEC_MODES == modes.mode_labels()
    assert replay.CODEC_MODES["w3"] == ("ct-int", 3, None)
    assert replay.CODEC_MODES["w4-g32"] == ("ct-int", 4, 32)
    assert {mode for mode, _, _ in replay.CODEC_MODES.values()} == \
        {m.name for m in MODES.values() if m.codec}


def _format_bank_modes() -> dict[str, tuple[set, int | None, tuple[str, ...]]]:
    """{mode: (bits, group sizes, parts)} from FORMAT.md "Bank parts"' table of codec modes."""
    text = (ROOT / "FORMAT.md").read_text()
    section = text[text.index("### Bank parts"):text.index("### Manifest file")]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            bits = {int(b) for b in cells[1].split(" or ")}
            groups = set() if cells[2] == "any" else {int(g) for g in cells[2].split(" or ")}
            out[cells[0].strip("`")] = (bits, groups, tuple(re.findall(r"`(\w+)`", cells[3])))
    return out


def test_format_md_lists_the_bank_modes():
    assert _format_bank_modes() == {m.name: (set(m.bits), set(m.groups), m.parts)
                                    for m in MODES.values()}
    headings = set(re.findall(r"^### (\S+)", (ROOT / "FORMAT.md").read_text(), re.M))
    assert {m.section for m in ROWS if m.section} <= headings

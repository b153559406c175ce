"""Deployment presets (`--config NAME|PATH`): the shipped files load and their numbers hold in
the memory plan; command-line flags win over a preset and a preset over the defaults; bad
presets are one-line errors naming the file and the key; generate/plan run with a preset."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
from test_config import k3_official

from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.checkpoint import ModelConfig
from mtplx_runtime.cli import main, parse_args
from mtplx_runtime.engine import presets
from mtplx_runtime.engine.plan import facts_from_config, plan_for
from mtplx_runtime.fixtures.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"k3-t158-h200", "k3-t158-cpu-256g", "k3-w3-h200", "tiny-demo"}
K3_MODES = {"k3-t158-h200": ("t158", None), "k3-t158-cpu-256g": ("t158", None),
            "k3-w3-h200": ("ct-int", 3)}  # the record codec each K3 preset is sized for
MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    make_tiny(root / "src", "t158")
    build_artifact(root / "src", root / "art", progress=False)
    return root / "art"


def bench_decode():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "tools/bench_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- the shipped presets -----------------------------------------------------------------------

def test_every_shipped_preset_loads_and_says_what_it_is_for():
    assert presets.CONFIG_DIR == ROOT / "mtplx_runtime" / "configs"
    assert SHIPPED <= set(presets.available())
    for name in presets.available():
        p = presets.load(name)
        assert p.name == name and p.path == presets.CONFIG_DIR / f"{name}.toml"
        assert {"memory_budget", "context", "prefill_chunk", "kernels"} <= set(p.values())
        head = p.path.read_text().splitlines()
        assert head[0].startswith("# ") and sum(ln.startswith("#") for ln in head) >= 5


def test_preset_keys_are_flags_of_the_config_commands():
    """Every key a preset may set is the dest of a flag of a command taking --config, with the
    same choices, so no key is dead and the schema cannot drift from the parsers."""
    parsers = [parse_args(["plan", "--model", "m", "--memory-budget", "1GiB"])]
    for cmd in ("generate", "chat", "serve"):
        argv = [cmd, "--model", "m"] + (["--prompt", "p"] if cmd == "generate" else [])
        parsers.append(parse_args(argv))
    dests = set().union(*(vars(a) for a in parsers)) | set(vars(bench_decode().build_parser()
                                                             .parse_args([])))
    assert set(presets.KEYS) <= dests
    from mtplx_runtime.cli import _build

    _, subs = _build()
    for cmd in ("generate", "chat", "serve", "plan"):
        for a in subs[cmd]._actions:
            if a.dest in presets.CHOICES and a.choices is not None:
                assert tuple(a.choices) == presets.CHOICES[a.dest], (cmd, a.dest)


@pytest.mark.parametrize("name", sorted(K3_MODES))
def test_k3_presets_fit_the_memory_plan(name):
    """The K3 presets' budgets plan on the full K3 config with the chunk they set, and that
    chunk is the plan's own pick at that budget (what their comments say)."""
    v = presets.load(name).values()
    facts = facts_from_config(ModelConfig.from_dict(k3_official()), *K3_MODES[name])
    kw = dict(memory_budget=v["memory_budget"], host_budget=v["host_budget"],
              context=v["context"], dtype=v["dtype"], kernels=v["kernels"])
    p = plan_for(facts, prefill_chunk=v["prefill_chunk"], **kw)
    assert p.compute_slots >= p.working_set_records
    assert p.items["residents"] == 113_509_540_864  # 105.71 GiB of BF16 residents
    assert plan_for(facts, **kw).prefill_chunk == v["prefill_chunk"]
    if v["kernels"] == "cuda":  # the budget is GPU memory: it must leave room on a 139 GiB H200
        assert p.memory_budget <= 130 * GiB


# ---- precedence --------------------------------------------------------------------------------

def test_flags_win_over_the_preset_and_the_preset_over_defaults(art, capsys):
    plain = plan_json(capsys, "--model", art, "--memory-budget", "542MiB")
    assert plain["context"] == 32768 and plain["host_budget"] == 0  # the built-in defaults
    got = plan_json(capsys, "--config", "tiny-demo", "--model", art)
    assert (got["memory_budget"], got["host_budget"]) == (461678 * 1024, 240 * 1024)
    assert (got["context"], got["prefill_chunk"]) == (512, 2)
    assert (got["compute_slots"], got["host_slots"]) == (17, 10)  # the preset's comment
    # Explicit flags win, also one equal to the parser's default (--context 4096), also when
    # given before --config; the keys not given still come from the preset.
    got = plan_json(capsys, "--memory-budget", "1GiB", "--config", "tiny-demo", "--model", art,
                    "--context", "4096")
    assert (got["memory_budget"], got["context"]) == (GiB, 4096)
    assert (got["host_budget"], got["prefill_chunk"]) == (240 * 1024, 2)
    by_path = plan_json(capsys, "--config", presets.CONFIG_DIR / "tiny-demo.toml", "--model", art)
    assert by_path["memory_budget"] == 461678 * 1024


def test_generate_chat_serve_take_the_preset():
    a = parse_args(["generate", "--config", "tiny-demo", "--model", "m", "--prompt", "p",
                    "--lookahead", "0", "--kernels", "reference"])
    assert (a.memory_budget, a.host_budget, a.context, a.max_tokens) == ("461678KiB", "240KiB",
                                                                         512, 16)
    assert (a.lookahead, a.kernels, a.top_k) == (0, "reference", 0)  # flags; a default
    a = parse_args(["chat", "--model", "m", "--config", "k3-t158-cpu-256g", "--lookahead", "1"])
    assert (a.kernels, a.memory_budget, a.prefill_chunk, a.lookahead) == ("cpu", "224GiB", 256, 1)
    a = parse_args(["serve", "--config", "k3-t158-h200", "--model", "m", "--port", "9000",
                    "--memory-budget", "100GiB"])
    assert (a.kernels, a.context, a.port, a.memory_budget) == ("cuda", 32768, 9000, "100GiB")
    assert parse_args(["generate", "--model", "m", "--prompt", "p"]).memory_budget is None


def test_plan_ignores_keys_it_has_no_flag_for(art, capsys):
    got = plan_json(capsys, "--config", "k3-t158-h200", "--model", art)  # lookahead, kernels...
    assert got["memory_budget"] == 128 * GiB and got["context"] == 32768
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--context", type=int, default=1)
    assert presets.apply(presets.load("tiny-demo"), p, "x") == [
        k for k in presets.load("tiny-demo").values() if k != "context"]
    assert p.parse_args([]).context == 512


def test_generate_streams_with_the_tiny_preset(art, capsys):
    assert main(["generate", "--config", "tiny-demo", "--model", str(art), "--prompt",
                 "The expert cache", "--kernels", "reference"]) == 0
    err = capsys.readouterr().err
    assert "generated 16 tok" in err and "cache hit rate" in err  # max_tokens 16, streamed
    assert main(["generate", "--config", "tiny-demo", "--model", str(art), "--prompt",
                 "The expert cache", "--kernels", "reference", "--max-tokens", "3"]) == 0
    assert "generated 3 tok" in capsys.readouterr().err


def test_bench_decode_takes_the_preset(tmp_path, capsys):
    mod = bench_decode()
    ap = mod.build_parser()
    assert presets.parse_args(ap, ["--config", "k3-t158-cpu-256g"]).kernels == "cpu"
    ap = mod.build_parser()
    a = presets.parse_args(ap, ["--kernels", "reference", "--config", "k3-t158-cpu-256g"])
    assert a.kernels == "reference" and a.slots_per_layer == 32
    bad = tmp_path / "bad.toml"
    bad.write_text("kernels = 'tpu'\n")
    assert mod.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_decode.py: error: ") and str(bad) in err and "kernels" in err
    assert err.count("\n") == 1


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, needles", [
    ("context = 512\nbogus = 1\n", ["unknown key 'bogus'"]),
    ("context = 'big'\n", ["context = 'big'", "expected an integer"]),
    ("context = 0\n", ["context = 0", "must be >= 1"]),
    ("lookahead = true\n", ["lookahead = True", "expected an integer"]),
    ("cache_policy = 'mru'\n", ["cache_policy = 'mru'", "'lru', 'freq'"]),
    ("memory_budget = '12 parsecs'\n", ["memory_budget = '12 parsecs'", "unit"]),
    ("memory_budget = 1.5\n", ["memory_budget = 1.5", "byte size"]),
    ("top_p = 0\n", ["top_p = 0", "(0, 1]"]),
    ("[serve]\nport = 1\n", ["unknown key 'serve'"]),
    ("context = \n", ["not valid TOML", "line 1"]),
])
def test_bad_preset_is_a_one_line_error_naming_file_and_key(tmp_path, capsys, text, needles):
    path = tmp_path / "site.toml"
    path.write_text(text)
    for argv in (["plan", "--model", "m"], ["generate", "--model", "m", "--prompt", "p"]):
        assert main([*argv, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mtplx {argv[0]}: error: {path}: ") and err.count("\n") == 1
        for needle in needles:
            assert needle in err, err


def test_missing_preset_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "gone.toml"
    assert main(["plan", "--model", "m", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"mtplx plan: error: {missing}: no such preset file\n"
    assert main(["serve", "--model", "m", "--config", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtplx serve: error: no preset named 'no-such-preset'")
    assert "tiny-demo" in err and err.count("\n") == 1


def test_a_value_the_command_refuses_names_key_file_and_command():
    p = argparse.ArgumentParser(prog="mtplx narrow")
    p.add_argument("--kernels", choices=("cpu",))
    presets.add_config_arg(p)
    with pytest.raises(presets.PresetError) as e:
        presets.parse_args(p, ["--config", "k3-t158-h200"])
    msg = str(e.value)
    assert "k3-t158-h200.toml" in msg and "kernels = 'cuda'" in msg and "mtplx narrow" in msg

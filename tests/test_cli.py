"""The CLI: every subcommand's --help works without a GPU, errors are messages, not tracebacks."""

import subprocess
import sys
from pathlib import Path

import pytest

import mtplx_runtime
from mtplx_runtime.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage: mtplx " + name in capsys.readouterr().out


def test_python_dash_m_is_the_same_cli():
    out = subprocess.run([sys.executable, "-m", "mtplx_runtime", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in out


def test_bad_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtplx inspect: error:") and "Traceback" not in err


STATS_ROWS = ("compute (decode)", "host (decode)", "transient (prefill)", "prefill ", "decode ",
              "bytes read / token", "stall share", "lookahead recall", "disk rate", "I/O bound")


def test_demo_builds_then_reuses_the_streaming_artifact(tmp_path, capsys):
    assert main(["demo", "--cache-dir", str(tmp_path), "--max-tokens", "8"]) == 0
    first = capsys.readouterr().out
    lines = first.splitlines()
    assert "(built in " in lines[0] and (tmp_path / "kimi-k3-tiny-kjv-stream"
                                         / "expert-manifest.json").is_file()
    assert "trained small Kimi K3" in lines[0] and "16 compute + 16 host slots" in first
    text = next(line for line in lines if line.startswith("text:   "))
    assert text[len("text:   "):].strip()
    assert "same 8 token ids as the resident model" in first
    for row in STATS_ROWS:
        assert any(line.startswith(row) for line in lines), row
    assert len(lines) < 40  # one screen
    assert main(["demo", "--cache-dir", str(tmp_path), "--max-tokens", "8"]) == 0
    second = capsys.readouterr().out
    assert "(reused in " in second.splitlines()[0]
    assert next(line for line in second.splitlines() if line.startswith("text:   ")) == text


def test_demo_disk_rate_reads_enough_and_a_beaten_bound_says_why(tmp_path, capsys,
                                                                   monkeypatch):
    from mtplx_runtime.artifact.manifest import load_manifest
    from mtplx_runtime.cli import demo

    assert main(["demo", "--cache-dir", str(tmp_path), "--max-tokens", "2"]) == 0
    capsys.readouterr()
    art = tmp_path / "kimi-k3-tiny-kjv-stream"
    one_pass = sum(r.sidecar_length for r in load_manifest(art / "expert-manifest.json").records)
    nbytes, secs = demo.measure_disk_rate(art, min_bytes=5 * one_pass + 1)
    assert nbytes == 6 * one_pass and secs > 0  # whole cold passes until enough was read
    # A disk "measured" at 100 B/s: the run's decode beats that bound, and the demo says why.
    monkeypatch.setattr(demo, "measure_disk_rate", lambda artifact: (1000, 10.0))
    assert main(["demo", "--cache-dir", str(tmp_path), "--max-tokens", "4"]) == 0
    assert "decode beat the bound" in capsys.readouterr().out


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_demo_streamed_tokens_equal_the_resident_models(tmp_path, kernels):
    import io

    from mtplx_runtime import load, load_model
    from mtplx_runtime.cli import demo
    from mtplx_runtime.engine.generate import generate
    from mtplx_runtime.engine.tokenizer import load_tokenizer

    artifact, built = demo.ensure_artifact(tmp_path, rebuild=False, seed=0)
    assert built
    tok = load_tokenizer(artifact)
    prompt = tok.encode(demo.PROMPT)
    rt = load(artifact, dtype="float32", kernels=kernels, lookahead=1, cache_slots=(2, 1))
    model, provider = rt.model, rt.provider
    with demo.one_compute_thread(), rt:
        assert provider.kernels.__name__.endswith("." + kernels)
        streamed, _, _ = demo.stream_generate(model, tok, prompt, 10, io.StringIO(), provider)
        assert provider.stats()["totals"]["compute"]["misses"] > 0  # it really streamed
        # the resident reference reads the source checkpoint, not the artifact
        resident, _ = generate(load_model(tmp_path / "tiny-t158-seed0", dtype="float32"),
                               prompt, max_tokens=10)
    assert streamed == resident


def test_demo_random_weights_streams_the_random_fixture(tmp_path, capsys):
    assert main(["demo", "--cache-dir", str(tmp_path), "--max-tokens", "4",
                 "--random-weights"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mtplx demo: random-weight tiny Kimi K3")
    assert (tmp_path / "tiny-t158-seed0-stream" / "expert-manifest.json").is_file()
    assert "2 compute + 2 host slots" in out and "the text is noise" in out


def test_demo_codec_table(tmp_path, capsys):
    assert main(["demo", "--cache-dir", str(tmp_path), "--max-tokens", "2", "--codecs"]) == 0
    out = capsys.readouterr().out
    for label in ("t158", "mxfp4", "w3-legacy", "w3-dense", "bf16"):
        row = next(line for line in out.splitlines() if line.startswith(label + " "))
        assert "exact 40/40" in row, row
    assert "7,741,440" in out and "14,270,464" in out and "13,418,496" in out


def test_inspect_reports_layout_and_sizes(tmp_path, capsys):
    from mtplx_runtime.fixtures.tiny import make_tiny

    make_tiny(tmp_path / "t", "t158", seed=3)
    assert main(["inspect", str(tmp_path / "t"), "--decode", "2"]) == 0
    out = capsys.readouterr().out
    assert "layout        t158" in out
    assert "5,760 (1.875 bits/weight)" in out  # 3 projections of 128x64 at 15 B per 64 weights
    assert out.count("finite True") == 6  # 2 experts x 3 projections
    make_tiny(tmp_path / "w3", "w3")
    assert main(["recode-w4", str(tmp_path / "w3"), str(tmp_path / "w4"), "--quiet"]) == 0
    for name, bits, packing in (("w3", 3, "legacy"), ("w4", 4, "dense")):
        assert main(["inspect", str(tmp_path / name)]) == 0
        assert (f"layout        compressed-tensors int W{bits} ({packing} packing, symmetric, "
                f"group 64); build-manifest keeps it as bank mode ct-int bits {bits}"
                ) in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"mtplx_runtime {mtplx_runtime.__version__}"


def test_the_model_directory_is_a_flag_or_a_positional_everywhere(tmp_path, capsys):
    """`--model DIR` and `DIR` are the same argument for every model-taking subcommand."""
    tiny = tmp_path / "t"
    assert main(["make-tiny", str(tiny), "--codec", "t158"]) == 0
    capsys.readouterr()
    outs = []
    for argv in (["inspect", str(tiny)], ["inspect", "--model", str(tiny)]):
        assert main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "t158" in outs[0]
    gen = ["--prompt", "hi", "--max-tokens", "2", "--dtype", "float32"]
    texts = []
    for argv in (["generate", str(tiny), *gen], ["generate", "--model", str(tiny), *gen]):
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert main(["plan", str(tiny), "--memory-budget", "8GiB"]) == 0
    capsys.readouterr()
    assert main(["generate", *gen]) == 2
    assert "the model directory is required: --model DIR (or DIR)" in capsys.readouterr().err
    assert main(["verify", str(tiny), "--model", str(tmp_path / "other")]) == 2
    assert "two model directories given" in capsys.readouterr().err
    for name in ("generate", "chat", "serve", "logits", "plan", "inspect", "verify",
                 "build-manifest"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert "--model DIR" in capsys.readouterr().out, name


def test_help_gives_every_options_default():
    """Every option of every subcommand says its default in --help (the shared formatter adds
    it unless the help text already does), and one with a value names that value (`generate
    --max-tokens` said only "default the rest of --context", `logits --dtype` "as generate's
    default")."""
    import argparse

    from mtplx_runtime.cli import DefaultsHelp, _build

    _, subs = _build()
    for name, p in subs.items():
        fmt = DefaultsHelp(prog=name)
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.default is argparse.SUPPRESS \
                    or a.required or not a.option_strings:
                continue
            text = fmt._get_help_string(a) % {"default": a.default}
            assert "default" in text, (name, a.option_strings)
            if a.default not in (None, False, True) and not isinstance(a.default, list):
                assert str(a.default) in text.replace(",", ""), (name, a.option_strings, text)
        assert p.format_help()  # every default formats (lists, None, booleans)


def test_chat_and_serve_help_do_not_offer_flags_they_refuse(capsys):
    """chat and serve have no --truncate: their --help must not point to it."""
    for name in ("chat", "serve"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert "truncate" not in capsys.readouterr().out, name


def test_each_codec_flag_has_its_own_name_and_the_old_spelling_still_works():
    """--codec meant three things: build-manifest's bank codec, make-tiny's expert layout,
    profile's pricing codec. Each has its own name now; --codec stays as an alias."""
    from mtplx_runtime.cli import parse_args

    for argv, dest, value in (
            (["build-manifest", "src", "out", "{}", "t158"], "bank_codec", "t158"),
            (["make-tiny", "out", "{}", "w3"], "layout", "w3"),
            (["profile", "synth:k3", "{}", "mxfp4"], "record_codec", "mxfp4")):
        new = {"bank_codec": "--bank-codec", "layout": "--layout",
               "record_codec": "--record-codec"}[dest]
        for flag in (new, "--codec"):
            args = parse_args([flag if a == "{}" else a for a in argv])
            assert getattr(args, dest) == value and not hasattr(args, "codec"), (argv, flag)


def test_build_manifest_takes_the_model_flag(tmp_path, capsys):
    """The README says every command with a model directory takes --model: build-manifest's
    source too (it was refused as an unknown flag)."""
    assert main(["make-tiny", str(tmp_path / "t"), "--layout", "t158"]) == 0
    assert main(["build-manifest", "--model", str(tmp_path / "t"), str(tmp_path / "a"),
                 "--quiet"]) == 0
    assert (tmp_path / "a" / "expert-manifest.json").is_file()
    assert main(["build-manifest", "-m", str(tmp_path / "t"), str(tmp_path / "b"), "--quiet",
                 "--bank-codec", "t158"]) == 0
    assert "t158" in capsys.readouterr().out


def test_short_flags_and_unknown_flags_name_the_subcommand(tmp_path, capsys):
    """`generate -m DIR -p TEXT -n N` as llama.cpp users type it; an unknown flag is reported
    by the subcommand, with its usage and the closest flag, not by the top-level parser."""
    tiny = tmp_path / "t"
    assert main(["make-tiny", str(tiny), "--layout", "t158"]) == 0
    capsys.readouterr()
    assert main(["generate", "-m", str(tiny), "-p", "hi", "-n", "2", "--dtype", "float32"]) == 0
    assert "generated 2 tok" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "-m", str(tiny), "-p", "hi", "--max-tokns=2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: mtplx generate ")
    assert err.splitlines()[-1] == ("mtplx generate: error: unrecognized arguments: "
                                    "--max-tokns=2; --max-tokns: did you mean --max-tokens?")
    # mlx-lm's -m is --max-tokens: a number where a directory should be gets a hint
    assert main(["generate", "-m", "100", "-p", "hi"]) == 2
    assert capsys.readouterr().err == ("mtplx generate: error: the model directory 100 does not "
                                       "exist (-m is --model here; the reply length is "
                                       "-n/--max-tokens)\n")


@pytest.mark.parametrize("flag", ["--trace-routes", "--warm"])
def test_output_files_need_an_existing_directory(tmp_path, capsys, flag):
    """--trace-routes and --warm FILE created missing parent directories silently (or failed
    after the whole load): now a one-line error naming the directory, before loading."""
    from mtplx_runtime.artifact.build import build_artifact
    from mtplx_runtime.fixtures.tiny import make_tiny

    make_tiny(tmp_path / "t", "t158")
    build_artifact(tmp_path / "t", tmp_path / "a", progress=False)
    target = tmp_path / "no" / "such" / "x.out"
    assert main(["generate", str(tmp_path / "a"), "-p", "hi", "-n", "1", flag,
                 str(target)]) == 2
    assert capsys.readouterr().err == (f"mtplx generate: error: {flag} {target}: its directory "
                                       f"{target.parent} does not exist (create it, or give "
                                       "another path)\n")
    assert not (tmp_path / "no").exists()


def test_a_closed_output_pipe_ends_quietly(tmp_path):
    """`mtplx inspect DIR | head -1`: the reader leaves; the command stops without a traceback
    or an error line (exit 141, as Unix tools)."""
    import subprocess
    import sys

    from mtplx_runtime.fixtures.tiny import make_tiny

    make_tiny(tmp_path / "t", "t158")
    proc = subprocess.Popen([sys.executable, "-m", "mtplx_runtime", "inspect", str(tmp_path / "t")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader before the child writes a byte
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""


def test_a_wrong_kind_of_directory_says_what_it_is_and_what_to_run(tmp_path, capsys):
    """verify of a checkpoint, build-manifest of an artifact, recode-w4 of a t158 checkpoint or
    of an artifact: one line that names what the directory is and the command that fits,
    instead of a missing manifest, a Python API or a missing quantization_config alone."""
    from mtplx_runtime.artifact.build import build_artifact
    from mtplx_runtime.fixtures.tiny import make_tiny

    ckpt, art = tmp_path / "t", tmp_path / "a"
    make_tiny(ckpt, "t158")
    build_artifact(ckpt, art, progress=False)
    capsys.readouterr()
    assert main(["verify", str(ckpt)]) == 2
    assert capsys.readouterr().err == (
        f"mtplx verify: error: {ckpt} is a checkpoint (config.json, no expert-manifest.json): "
        f"verify checks a streaming artifact against its manifest; `mtplx build-manifest {ckpt} "
        f"OUT` builds one, `mtplx inspect {ckpt}` summarises the checkpoint\n")
    assert main(["build-manifest", str(art), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err == (f"mtplx build-manifest: error: {art} is a streaming artifact already "
                   f"(expert-manifest.json), and build-manifest reads a checkpoint: run it with "
                   f"`mtplx generate {art}`, check it with `mtplx verify {art}`\n")
    assert not (tmp_path / "b").exists()
    assert main(["recode-w4", str(ckpt), str(tmp_path / "w4")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtplx recode-w4: error: ") and err.count("\n") == 1
    assert "its routed experts are t158, not W3: recode-w4 recodes a W3A16 g64" in err
    assert main(["recode-w4", str(art), str(tmp_path / "w4")]) == 2
    assert "it is a streaming artifact: recode-w4 reads the W3A16 checkpoint" in \
        capsys.readouterr().err
    make_tiny(tmp_path / "w3", "w3")
    assert main(["recode-w4", str(tmp_path / "w3"), str(tmp_path / "w4"), "--quiet"]) == 0
    assert main(["recode-w4", str(tmp_path / "w4"), str(tmp_path / "w4b")]) == 2
    assert "its experts are already W4: nothing to recode" in capsys.readouterr().err


def test_the_first_native_build_is_announced(tmp_path, monkeypatch):
    """The native CPU library compiles on first use (10-20 s): a line says so, once; once it is
    built nothing is said (the wheel test sees the line from a real first run)."""
    import io

    from mtplx_runtime.cli.common import note_native_build
    from mtplx_runtime.kernels import cpu_build

    monkeypatch.setenv("MTPLX_NATIVE_DIR", str(tmp_path))
    err = io.StringIO()
    note_native_build(err)
    assert err.getvalue() == f"mtplx: compiling the native CPU kernels, once (kept in {tmp_path})\n"
    cpu_build.library_path().touch()  # as if built
    note_native_build(err := io.StringIO())
    assert err.getvalue() == ""


def test_flags_parse_without_torch():
    """Every command's flags (presets and load options included) parse without importing torch,
    so `--help` and a plan answer quickly; importing torch alone took 1-3 s here."""
    code = ("import sys; from mtplx_runtime.cli import parse_args; "
            "parse_args(['plan', 'x', '--config', 'k3-t158-h200']); "
            "parse_args(['generate', '-m', 'x', '-p', 'hi']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

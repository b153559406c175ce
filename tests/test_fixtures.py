"""Fixture generation: the tiny tokenizer and the tiny K3 checkpoint in every published layout."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load

from mtplx_runtime.checkpoint import open_checkpoint, resident_tensor_specs
from mtplx_runtime.checkpoint.safetensors_io import SafetensorsFile
from mtplx_runtime.cli import make_tiny
from mtplx_runtime.fixtures import tiny, tiny_weights
from mtplx_runtime.fixtures import tokenizer as tok
from mtplx_runtime.formats.t158 import T158Codec


@pytest.fixture
def encoding(tmp_path, monkeypatch):
    # tiktoken caches files by *path* in a temp dir; a stale entry for a reused tmp path would
    # shadow the file just written, so caching is switched off.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    vocab_size = tok.write_tokenizer(tmp_path)
    ranks = tiktoken.load.load_tiktoken_bpe(str(tmp_path / "tiktoken.model"))
    specials = tok.special_tokens(len(ranks))
    assert vocab_size == len(ranks) + 256
    return tiktoken.Encoding(
        name="tiny", pat_str=tok.PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    )


def test_ranks_are_a_consistent_bpe():
    ranks = tok.build_tiny_ranks()
    assert sorted(ranks.values()) == list(range(tok.TARGET_RANKS))
    assert all(ranks[bytes([i])] == i for i in range(256))
    for t, r in ranks.items():
        if len(t) > 1:
            assert any(
                ranks.get(t[:i], r) < r and ranks.get(t[i:], r) < r for i in range(1, len(t))
            ), t
    assert tok.build_tiny_ranks() == ranks


def test_tiktoken_round_trip(encoding):
    texts = ["The experts are many.", "def f(x):\n    return x @ w  # 7168\n", "naïve 日本 ✓"]
    for text in texts:
        ids = encoding.encode(text)
        assert encoding.decode(ids) == text
        assert max(ids) < tok.TARGET_RANKS
    # Trained words come back as one token.
    assert len(encoding.encode(" projection")) == 1


def test_specials_encode_as_single_ids(encoding):
    n = tok.TARGET_RANKS
    specials = tok.special_tokens(n)
    assert len(specials) == 256 and sorted(specials.values()) == list(range(n, n + 256))
    assert specials["[BOS]"] == n and specials["[EOS]"] == n + 1
    assert specials["<|end_of_msg|>"] == n + 2 and specials["[EOT]"] == n + 9
    assert specials["<|media_pad|>"] == n + 21 and specials["<osagent_mode>"] == n + 65
    assert specials["[UNK]"] == n + 254 and specials["[PAD]"] == n + 255
    assert specials[f"<|reserved_token_{n + 8}|>"] == n + 8
    text = "[BOS]<|open|>message<|sep|>hi<|close|>message<|sep|><|end_of_msg|>"
    ids = encoding.encode(text, allowed_special="all")
    assert ids[:2] == [n, n + 3] and ids[-1] == n + 2
    assert encoding.decode(ids) == text
    # Without allow-listing, special text is ordinary BPE (what XTML does for user text).
    assert n + 3 not in encoding.encode("<|open|>", disallowed_special=())


def test_tokenizer_config_matches_release_shape(tmp_path):
    tok.write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    n = tok.TARGET_RANKS
    dec = cfg["added_tokens_decoder"]
    assert len(dec) == 16
    assert dec[str(n + 3)] == {
        "content": "<|open|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": False,
    }
    assert dec[str(n + 2)]["special"] is True
    assert {dec[str(n + k)]["content"] for k in (3, 4, 5)} == {"<|open|>", "<|close|>", "<|sep|>"}
    assert (cfg["bos_token"], cfg["eos_token"]) == ("[BOS]", "[EOS]")


# ---- the tiny checkpoint ----

# (id, codec, make_tiny keyword arguments)
VARIANTS = [
    ("mxfp4", "mxfp4", {}),
    ("w3-legacy-sym", "w3", {"w3_layout": "legacy"}),
    ("w3-legacy-asym", "w3", {"w3_layout": "legacy", "w3_symmetric": False}),
    ("w3-dense-sym", "w3", {"w3_layout": "dense"}),
    ("w3-dense-asym", "w3", {"w3_layout": "dense", "w3_symmetric": False}),
    ("t158", "t158", {}),
    ("bf16", "bf16", {}),
]
IDS = [v[0] for v in VARIANTS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every variant written once with seed 0: {id: TinyInfo}."""
    return {
        vid: tiny.make_tiny(tmp_path_factory.mktemp(vid), codec, seed=0, **kw)
        for vid, codec, kw in VARIANTS
    }


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_tiny_config_has_k3_features():
    cfg = tiny.tiny_config()
    assert [cfg.is_kda_layer(layer) for layer in range(6)] == [True, True, True, False, True, False]
    assert cfg.moe_layers == [1, 2, 3, 4, 5] and cfg.attn_res_block_starts == [0, 2, 4]
    assert cfg.vocab_size == tok.TARGET_RANKS + 256
    n = tok.TARGET_RANKS
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (n, n + 2, n + 255)
    assert cfg.expert_shapes == {"gate": (128, 64), "up": (128, 64), "down": (64, 128)}
    # FORMAT.md "Resident tensors": KDA layers x 20 + MLA x 14 + MoE x 8 + dense MLP 3 + global 5.
    assert len(resident_tensor_specs(cfg)) == 4 * 20 + 2 * 14 + 5 * 8 + 3 + 5


@pytest.mark.parametrize("vid", IDS)
def test_every_expert_decodes_to_the_drawn_truth(built, vid):
    info = built[vid]
    with open_checkpoint(info.path) as ck:
        assert ck.layout == info.codec
        if info.codec == "w3":
            assert (ck.codec.layout, ck.codec.symmetric) == (info.w3_layout, info.w3_symmetric)
        for layer in ck.config.moe_layers:
            for e in range(ck.config.num_experts):
                got = ck.expert(layer, e).decode()
                want = info.expert_weights(layer, e)
                assert got.keys() == want.keys() == {"gate", "up", "down"}
                for proj in want:
                    assert np.array_equal(got[proj], want[proj]), (layer, e, proj)
        # The truth is not degenerate: experts differ and weights are about 1/sqrt(fan_in).
        w = info.expert_weights(1, 0)["gate"]
        assert not np.array_equal(w, info.expert_weights(1, 1)["gate"])
        assert 0.03 < float(np.std(w)) < 0.3


def test_trunk_is_identical_across_codecs(built):
    ref = built["mxfp4"]
    names = list(resident_tensor_specs(ref.config))
    with open_checkpoint(ref.path) as a:
        want = {n: a.tensor(n).tobytes() for n in names}
    for vid in IDS[1:]:
        with open_checkpoint(built[vid].path) as b:
            for n in names:
                assert b.tensor(n).tobytes() == want[n], (vid, n)


def test_same_args_give_identical_bytes(built, tmp_path):
    for vid, codec, kw in VARIANTS:
        again = tiny.make_tiny(tmp_path / vid, codec, seed=0, **kw)
        assert _digests(again.path) == _digests(built[vid].path), vid
    other = tiny.make_tiny(tmp_path / "seed1", "t158", seed=1)
    a, b = _digests(other.path), _digests(built["t158"].path)
    assert a["tiktoken.model"] == b["tiktoken.model"]
    assert a["model-00001-of-00003.safetensors"] != b["model-00001-of-00003.safetensors"]


def test_trunk_values_are_sensible(built):
    info = built["bf16"]
    cfg = info.config
    with open_checkpoint(info.path) as ck:
        for name, spec in resident_tensor_specs(cfg).items():
            t = ck.tensor_info(name)
            assert (t.dtype, t.shape) == (spec.dtype, spec.shape), name
        a_log = ck.tensor("language_model.model.layers.0.self_attn.A_log")
        assert a_log.shape == (128,) and a_log.dtype == np.float32
        assert (a_log[:4] >= 0).all() and (a_log[:4] <= np.log(16)).all() and a_log[:4].any()
        assert not a_log[4:].any()  # padding, as the published checkpoint has it
        norm = ck.tensor("language_model.model.norm.weight")  # BF16 bits
        vals = (norm.astype(np.uint32) << 16).view(np.float32)
        assert ((vals > 0.89) & (vals < 1.11)).all()
        moe = "language_model.model.layers.1.block_sparse_moe."
        bias = ck.tensor(moe + "gate.e_score_correction_bias")
        assert bias.dtype == np.float32 and np.abs(bias).max() < 0.2


def test_layout_files_per_codec(built):
    mx = json.loads((built["mxfp4"].path / "config.json").read_text())
    qc = mx["text_config"]["quantization_config"]
    assert "quantization_config" not in mx and mx["model_type"] == "kimi_k3"
    assert qc["format"] == "mxfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"} <= set(qc["ignore"])

    for vid, version, symmetric in [("w3-legacy-sym", "0.17.1", True),
                                    ("w3-dense-asym", "0.20.1", False)]:
        cfg = json.loads((built[vid].path / "config.json").read_text())
        qc = cfg["quantization_config"]
        assert qc["version"] == version and qc["format"] == "pack-quantized"
        assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 3
        assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is symmetric
        index = json.loads((built[vid].path / "model.safetensors.index.json").read_text())
        base = "language_model.model.layers.1.block_sparse_moe.experts.0.w1."
        assert (base + "weight_zero_point" in index["weight_map"]) is not symmetric
        shard = SafetensorsFile(built[vid].path / index["weight_map"][base + "weight_shape"])
        assert shard.tensors[base + "weight_shape"].dtype == "I64"
        assert shard.read(base + "weight_shape").tolist() == [128, 64]
        shard.close()

    flat = json.loads((built["t158"].path / "config.json").read_text())
    assert flat["model_type"] == "kimi_linear" and "text_config" not in flat
    assert "quantization_config" not in flat
    with open_checkpoint(built["t158"].path) as ck:
        packed = ck.tensor_info("model.layers.5.mlp.switch_mlp.down_proj.packed")
        scales = ck.tensor_info("model.layers.5.mlp.switch_mlp.down_proj.scales")
        assert (packed.dtype, packed.shape) == ("U8", (8, 64, 13 * 128 // 64))
        assert (scales.dtype, scales.shape) == ("U16", (8, 64, 128 // 64))

    bf = json.loads((built["bf16"].path / "config.json").read_text())
    assert "quantization_config" not in bf and "quantization_config" not in bf["text_config"]

    for info in built.values():
        files = {p.name for p in info.path.iterdir()}
        assert {"config.json", "generation_config.json", "tiktoken.model", "fixture.json",
                "tokenizer_config.json", "model.safetensors.index.json"} <= files
        index = json.loads((info.path / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        sizes = 0
        for s in shards:
            with SafetensorsFile(info.path / s) as f:
                sizes += sum(t.nbytes for t in f.tensors.values())
        assert index["metadata"]["total_size"] == sizes
        fixture = json.loads((info.path / "fixture.json").read_text())
        assert fixture["codec"] == info.codec and fixture["total_bytes"] == sizes


def test_writer_self_check_catches_a_drifting_encoder(monkeypatch):
    real = T158Codec.encode

    def drifted(self, weight):
        parts = real(self, weight)
        parts["packed"][0, 0] ^= 1
        return parts

    monkeypatch.setattr(T158Codec, "encode", drifted)
    with pytest.raises(AssertionError, match="changed the drawn"):
        tiny_weights.draw_expert(tiny.tiny_config(), tiny_weights.ExpertCodec("t158"), 0, 1, 0)


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="mtplx make-tiny")
    make_tiny.add_args(parser)
    args = parser.parse_args([str(tmp_path / "w3"), "--codec", "w3", "--seed", "3",
                              "--w3-layout", "dense", "--w3-asymmetric"])
    assert make_tiny.main(args) == 0
    fixture = json.loads((tmp_path / "w3" / "fixture.json").read_text())
    assert (fixture["seed"], fixture["w3_layout"], fixture["w3_symmetric"]) == (3, "dense", False)
    assert "w3 seed=3" in capsys.readouterr().out
    assert tiny.TinyInfo.load(tmp_path / "w3") == tiny.TinyInfo(
        tmp_path / "w3", "w3", tiny.tiny_config(), 3, "dense", False, 64)
    bad = parser.parse_args([str(tmp_path / "m"), "--codec", "mxfp4", "--w3-layout", "dense"])
    assert make_tiny.main(bad) == 2
    # An existing checkpoint is refused, and replaced whole (no stale file) only with --force.
    again = parser.parse_args([str(tmp_path / "w3"), "--codec", "t158"])
    assert make_tiny.main(again) == 2 and "--force" in capsys.readouterr().err
    (tmp_path / "w3" / "stale.bin").write_bytes(b"x")
    forced = parser.parse_args([str(tmp_path / "w3"), "--codec", "t158", "--force"])
    assert make_tiny.main(forced) == 0
    assert not (tmp_path / "w3" / "stale.bin").exists()
    assert tiny.TinyInfo.load(tmp_path / "w3").codec == "t158"

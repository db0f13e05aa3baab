"""Model shapes: parameter counts of known models, FLOPs, Hugging Face import, validation errors."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hethub.errors import SpecError
from hethub.spec.model import PRESETS, ModelSpec, get_model


@pytest.mark.parametrize(("name", "expected"), [
    ("llama-2-7b", 6.74e9),
    ("llama-2-13b", 1.30e10),
    ("llama-2-70b", 6.90e10),
    ("llama-3-8b", 8.03e9),
])
def test_parameter_counts_match_published(name, expected):
    assert PRESETS[name].num_params == pytest.approx(expected, rel=0.01)


def test_flops_per_token_is_6n_plus_attention():
    m = PRESETS["llama-2-7b"]
    s = 4096
    # Exactly: 6 x (matmul weights incl. the head) + 12 L h s for the attention scores and values.
    matmul_weights = m.num_layers * m.layer_matmul_params + m.vocab_size * m.hidden_size
    exact = 6 * matmul_weights + 12 * m.num_layers * m.hidden_size * s
    assert m.train_flops_per_token(seq_len=s) == pytest.approx(exact)
    # The usual rule of thumb with N = all parameters is off only by the embedding and norms.
    rule = 6 * m.num_params + 12 * m.num_layers * m.hidden_size * s
    assert m.train_flops_per_token(seq_len=s) == pytest.approx(rule, rel=0.03)


def test_embedding_elems_split_the_token_table_and_replicate_positions():
    llama, gpt = PRESETS["llama-2-7b"], PRESETS["opt-350m"]
    assert llama.embedding_parts == (32000 * 4096, 0)
    assert gpt.embedding_parts == (50272 * 1024, 2048 * 1024)  # learned positions, one row per position
    for m in (llama, gpt):
        assert sum(m.embedding_parts) == m.embedding_params
        assert m.embedding_elems(1) == m.embedding_params
    assert llama.embedding_elems(4) == 32000 * 4096 / 4
    assert gpt.embedding_elems(8) == 50272 * 1024 / 8 + 2048 * 1024  # the positions stay whole on every rank


def test_vocab_tp_is_the_runtimes_vocabulary_parallel_rule():
    """A TP degree that does not divide the vocabulary replicates the table (tensor_parallel.vocab_parallel)."""
    gpt_neo, llama = PRESETS["gpt-neo-2.7b"], PRESETS["llama-2-7b"]  # vocabularies 50257 (odd), 32000
    assert [gpt_neo.vocab_tp(t) for t in (1, 2, 4, 29)] == [1, 1, 1, 29]  # 50257 = 29 x 1733
    assert [llama.vocab_tp(t) for t in (1, 2, 8, 3)] == [1, 2, 8, 1]
    assert gpt_neo.embedding_elems(gpt_neo.vocab_tp(2)) == gpt_neo.embedding_params
    vocab_parallel = pytest.importorskip("hethub.runtime.tensor_parallel").vocab_parallel
    for vocab in (255, 256, 250, 50257, 32000):
        m = replace(llama, vocab_size=vocab)
        assert all((m.vocab_tp(t) > 1) == vocab_parallel(vocab, t) for t in range(1, 17))


def write_config(tmp_path: Path, cfg: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    p = d / "config.json"
    p.write_text(json.dumps(cfg), encoding="utf-8")
    return p


def test_hf_llama_config(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False}
    m = get_model(str(write_config(tmp_path, cfg, "Meta-Llama-3-8B")))
    assert m.name == "Meta-Llama-3-8B"
    assert m.arch == "llama" and m.num_kv_heads == 8 and not m.tied_embeddings
    assert m.num_params == PRESETS["llama-3-8b"].num_params


def test_hf_llama_without_kv_heads_is_mha(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 256}
    m = get_model(str(write_config(tmp_path, cfg)))
    assert m.num_kv_heads == 4


def test_hf_gpt2_config_matches_published_count(tmp_path):
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None,
           "vocab_size": 50257, "n_positions": 1024}
    m = get_model(str(write_config(tmp_path, cfg)))
    assert (m.arch, m.activation, m.tied_embeddings, m.ffn_hidden_size) == ("gpt", "gelu", True, 3072)
    assert m.num_params == 124_439_808  # GPT-2 small, exactly


def test_hf_opt_config(tmp_path):
    cfg = {"model_type": "opt", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
           "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048, "activation_function": "relu"}
    m = get_model(str(write_config(tmp_path, cfg)))
    assert m.activation == "relu" and m.arch == "gpt"
    # OPT-125m has 125,239,296; OPT's two extra position rows (offset 2) are not modelled.
    assert m.num_params == pytest.approx(125_239_296, rel=1e-3)


def test_hf_gpt_neo_config(tmp_path):
    cfg = {"model_type": "gpt_neo", "num_layers": 12, "hidden_size": 768, "num_heads": 12,
           "intermediate_size": None, "vocab_size": 50257, "max_position_embeddings": 2048}
    m = get_model(str(write_config(tmp_path, cfg)))
    assert m.ffn_hidden_size == 4 * 768 and m.activation == "gelu"
    # GPT-Neo-125M has 125,198,592 (no q/k/v biases, which the GPT family here assumes).
    assert m.num_params == pytest.approx(125_198_592, rel=1e-3)


def test_hf_config_missing_field_is_named(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 256,
           "intermediate_size": 128}
    with pytest.raises(SpecError, match="num_attention_heads"):
        get_model(str(write_config(tmp_path, cfg)))


def test_hf_unsupported_model_type(tmp_path):
    with pytest.raises(SpecError, match="model_type"):
        get_model(str(write_config(tmp_path, {"model_type": "t5"})))


def test_heads_must_divide_hidden():
    with pytest.raises(SpecError, match="'num_heads'"):
        replace(PRESETS["tiny"], num_heads=3)


def test_kv_heads_must_divide_heads():
    with pytest.raises(SpecError, match="'num_kv_heads'"):
        replace(PRESETS["tiny"], num_kv_heads=3)


def test_non_positive_field_is_named():
    with pytest.raises(SpecError, match="'num_layers'"):
        replace(PRESETS["tiny"], num_layers=0)


def test_unknown_arch_is_named():
    with pytest.raises(SpecError, match="'arch'"):
        replace(PRESETS["tiny"], arch="mamba")


def test_unknown_preset():
    with pytest.raises(SpecError, match="unknown model 'llama-9b'"):
        get_model("llama-9b")


def test_missing_config_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        get_model(str(tmp_path / "nope.json"))


def test_bad_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json", encoding="utf-8")
    with pytest.raises(SpecError, match="not valid JSON"):
        get_model(str(p))


def test_from_dict_unknown_field_is_named():
    data = {**PRESETS["tiny"].to_dict(), "num_experts": 8}
    with pytest.raises(SpecError, match="'num_experts'"):
        ModelSpec.from_dict(data)


def test_to_dict_round_trip():
    for m in PRESETS.values():
        assert ModelSpec.from_dict(m.to_dict()) == m

"""Memory model: training state per parameter, TP splits, activations in flight, recomputation."""

import pytest

from hethub.predict.memory import stage_memory, stage_params
from hethub.spec.model import PRESETS, ModelSpec

M = PRESETS["llama-2-7b"]


def test_bf16_mixed_is_16_bytes_per_param_and_fp32_is_16_too():
    assert sum(ModelSpec.state_bytes_per_param("bf16-mixed").values()) == 16
    assert ModelSpec.state_bytes_per_param("bf16-mixed")["grads"] == 2
    assert sum(ModelSpec.state_bytes_per_param("fp32").values()) == 16
    with pytest.raises(ValueError, match="precision"):
        ModelSpec.state_bytes_per_param("fp8")


def test_state_bytes_follow_params():
    mem = stage_memory(M, layers=4, embedding=False, head=False, tp=1, mbs=1, seq_len=1024, recompute=False,
                       precision="bf16-mixed", in_flight=1)
    params = 4 * M.layer_params
    assert mem.weights_bytes == 2 * params
    assert mem.grads_bytes == 2 * params
    assert mem.optimizer_bytes == 12 * params


def test_whole_model_on_one_stage_counts_every_parameter():
    # An untied model on one device holds exactly num_params.
    n = stage_params(M, layers=M.num_layers, embedding=True, head=True, tp=1)
    assert n == M.num_params


def test_tp_splits_matmuls_and_vocab_but_not_norms():
    h = M.hidden_size
    one = stage_params(M, layers=1, embedding=False, head=False, tp=1)
    four = stage_params(M, layers=1, embedding=False, head=False, tp=4)
    norms = M.layer_params - M.layer_matmul_params
    assert four == pytest.approx(M.layer_matmul_params / 4 + norms)
    assert one / four == pytest.approx(4, rel=0.01)
    emb = stage_params(M, layers=0, embedding=True, head=False, tp=2)
    assert emb == M.vocab_size * h / 2
    head = stage_params(M, layers=0, embedding=False, head=True, tp=2)
    assert head == M.vocab_size * h / 2 + M.final_norm_params


def test_activations_scale_with_in_flight():
    kw = dict(layers=8, embedding=False, head=False, tp=1, mbs=1, seq_len=2048, recompute=False,
              precision="bf16-mixed")
    one = stage_memory(M, in_flight=1, **kw).activations_bytes
    four = stage_memory(M, in_flight=4, **kw).activations_bytes
    assert four == pytest.approx(4 * one)


def test_recompute_reduces_activations_a_lot():
    kw = dict(layers=16, embedding=False, head=False, tp=1, mbs=2, seq_len=4096, precision="bf16-mixed",
              in_flight=4)
    full = stage_memory(M, recompute=False, **kw).activations_bytes
    recomputed = stage_memory(M, recompute=True, **kw).activations_bytes
    assert recomputed < full / 5
    # Weights and optimizer state do not change.
    assert stage_memory(M, recompute=True, **kw).weights_bytes == stage_memory(M, recompute=False, **kw).weights_bytes


def test_tp_reduces_activations_but_not_the_replicated_part():
    kw = dict(layers=4, embedding=False, head=False, mbs=1, seq_len=2048, recompute=False, precision="bf16-mixed",
              in_flight=1)
    a1 = stage_memory(M, tp=1, **kw).activations_bytes
    a8 = stage_memory(M, tp=8, **kw).activations_bytes
    assert a1 / 8 < a8 < a1


def test_head_adds_logits():
    kw = dict(layers=1, embedding=False, tp=1, mbs=1, seq_len=2048, recompute=False, precision="bf16-mixed",
              in_flight=1)
    with_head = stage_memory(M, head=True, **kw).activations_bytes
    without = stage_memory(M, head=False, **kw).activations_bytes
    # fp32 logits and their softmax: 8 bytes per vocab entry per token.
    assert with_head - without >= 2048 * M.vocab_size * 8

"""Loading a single-file checkpoint holds the weights once (issue 29, item 4): peak host memory, chunked reads, errors.

Peak memory is measured by ``dllm.eval.study.load_memory`` in a fresh interpreter per load, so that the high-water mark
is that load's alone: ``VmHWM`` from /proc/self/status (the resident high-water mark, which starts afresh at exec;
``ru_maxrss`` would carry over the parent's, which wrote the checkpoint) minus the resident size just before the
load, with torch, accelerate, safetensors and torch's meta kernels already imported (code, whatever the size).
Resident size counts the pages of a memory-mapped file the process has read: a loader that keeps the whole file
mapped while copying it into allocated parameters shows up as twice the weights.
"""

import json

import pytest
import torch
from test_checkpoint import assert_matches_hub, empty_tiny, hub_state, rename, save_sharded

from dllm.eval.study.load_memory import llada_like, measure_in_child, write_checkpoint
from dllm.models import checkpoint
from dllm.models.checkpoint import load_checkpoint
from dllm.models.transformer import TransformerConfig, TransformerLM

BOUND = 1.2  # peak above baseline, as a multiple of the checkpoint's bytes


@pytest.fixture(scope="module")
def single_file(tmp_path_factory):
    """384 MiB of random bf16 weights in one model.safetensors (58 tensors, the largest 64 MiB)."""
    folder = tmp_path_factory.mktemp("single")
    write_checkpoint(folder, llada_like(8, dim=1024, mlp_hidden=4096, vocab_size=32768))
    return folder


def test_from_pretrained_of_one_file_peaks_near_the_weights(single_file):
    result = measure_in_child("from_pretrained", single_file)
    assert result["weights_mib"] > 300 and result["dtypes"] == ["torch.bfloat16"]
    assert result["ratio"] <= BOUND, result


def test_the_harness_sees_a_second_copy(single_file):
    # load_file's tensors map the file; copying them into allocated parameters holds the weights twice
    result = measure_in_child("load_file_copy", single_file)
    assert result["ratio"] > BOUND, result


def test_tensors_larger_than_a_chunk_are_read_row_range_by_row_range(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_CHUNK_BYTES", 64)  # 2 rows of 16 bf16 values: many chunks per tensor
    state = hub_state(torch.bfloat16)
    model = load_checkpoint(empty_tiny(), save_sharded(tmp_path / "ckpt", state, max_shard_size=10**9), rename)
    assert_matches_hub(model, state, torch.bfloat16)  # fused q/k/v and gate/up rows at their offsets too


def _tiny(**changes) -> TransformerConfig:
    values = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16, layout="bidirectional",
                  mask_token_id=31)
    return TransformerConfig(**{**values, **changes})


def _write_config(folder, config: TransformerConfig) -> None:
    (folder / "config.json").write_text(json.dumps(config.to_dict()))


def test_a_mismatching_checkpoint_is_refused_by_name(tmp_path):
    TransformerLM(_tiny()).save_pretrained(tmp_path)
    _write_config(tmp_path, _tiny(n_layers=3))
    with pytest.raises(ValueError, match=r"model.safetensors does not match its config: missing \['layers.2.attn"):
        TransformerLM.from_pretrained(tmp_path)
    TransformerLM(_tiny(tie_embeddings=False)).save_pretrained(tmp_path)
    _write_config(tmp_path, _tiny())  # tied: output.weight is the embedding, stored once
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['output.weight'\]"):
        TransformerLM.from_pretrained(tmp_path)


def test_loaded_weights_keep_their_ties_dtype_and_device(tmp_path):
    TransformerLM(_tiny()).save_pretrained(tmp_path)
    model = TransformerLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]) and not model.training

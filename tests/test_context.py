"""`generate` refuses prompt + max_new_tokens beyond the model's declared context, before any model call, for
every sampler; and each model kind declares its context (TransformerLM, HF configs, the real LLaDA/Dream ones)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from fixtures.hf import builders
from fixtures.hf.remote_checkpoints import auto_registrations_restored

import dllm
from dllm.models.hf import config_context_length
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import context_length
from dllm.samplers import SAMPLERS

REMOTE = Path(__file__).resolve().parents[1].parent / "shared" / "remote_code"
REMOTE = next((d for d in (REMOTE, Path(__file__).resolve().parents[2].parent / "shared" / "remote_code")
               if d.is_dir()), REMOTE)  # beside the main checkout, or above a worktree (wt/NAME)
VOCAB, EOS, MASK, LIMIT = 8, 1, 7, 12


class EosFirst:
    """A model whose every position puts all mass on EOS (so any sampler could stop at once); counts calls."""

    def __init__(self, causal: bool, limit: int | None):
        self.vocab_size, self.eos_token_id, self.calls = VOCAB, EOS, 0
        if limit is not None:
            self.context_length = limit
        if not causal:
            self.mask_token_id = MASK

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V]
        self.calls += 1
        logits = torch.full((*input_ids.shape, VOCAB), -30.0)
        logits[..., EOS] = 0.0
        logits[..., MASK] = -torch.inf
        return logits


SAMPLED = sorted(name for name in SAMPLERS if name != "native")  # native: a model's own loop, tested below


@pytest.mark.parametrize("sampler", SAMPLED)
def test_every_sampler_refuses_a_request_past_the_context_before_calling_the_model(sampler):
    causal = SAMPLERS[sampler].model_kind == "causal"
    model = EosFirst(causal, LIMIT)
    room = LIMIT - 8 + causal  # a causal model never reads the last token it samples
    options = {"block_length": 4} if "block_length" in SAMPLERS[sampler].options else {}
    with pytest.raises(ValueError, match=rf"prompt length {room + 1} \+ max_new_tokens 8 = {room + 9} tokens exceeds "
                                         rf"the model's context of 12.*\(EosFirst.context_length\).*"
                                         rf"max_new_tokens <= 7 fits"):
        dllm.generate(model, torch.full((2, room + 1), 3), sampler=sampler, max_new_tokens=8, temperature=0.0,
                      **options)
    assert model.calls == 0
    # At the limit it runs, and stops at once (the stop token kept, the rest filled).
    out = dllm.generate(model, torch.full((2, room), 3), sampler=sampler, max_new_tokens=8, temperature=0.0,
                        **options)
    assert out.sequences.shape == (2, room + 8) and out.sequences[:, room].tolist() == [EOS, EOS]


def test_models_without_a_declared_context_are_not_checked():
    model = EosFirst(causal=False, limit=None)
    out = dllm.generate(model, torch.full((1, 40), 3), sampler="fef", max_new_tokens=8, temperature=0.0)
    assert out.sequences.shape == (1, 48) and context_length(model) is None


def test_the_prompt_alone_filling_the_context_says_so():
    with pytest.raises(ValueError, match="the prompt alone fills the context"):
        dllm.generate(EosFirst(causal=False, limit=LIMIT), torch.full((1, 12), 3), sampler="fef", max_new_tokens=1)


@pytest.mark.parametrize("layout", ["block_causal", "causal"])
def test_transformer_counts_real_tokens_not_padding(layout):
    """Positions come from the mask: over-padded rows fit when their real tokens do, on the real model."""
    config = TransformerConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, max_seq_len=24, layout=layout,
                               mask_token_id=15 if layout != "causal" else None, eos_token_id=1, pad_token_id=0,
                               **({"block_size": 4} if layout == "block_causal" else {}))
    model = TransformerLM(config).eval()
    assert context_length(model) == 24
    ids = torch.randint(3, 14, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # 16 real tokens per row, 20 columns
    sampler = "ar" if layout == "causal" else "fef"
    out = dllm.generate(model, ids, sampler=sampler, max_new_tokens=8, temperature=1.0, attention_mask=mask,
                        generator=torch.Generator().manual_seed(1), eos_token_id=None)
    assert out.sequences.shape == (2, 28)
    mask[0, 2:4] = 1  # row 0 now holds 18 real tokens: one more than a causal model's limit, two for diffusion
    with pytest.raises(ValueError, match="prompt length 18 \\+ max_new_tokens 8 = 26 tokens exceeds the model's "
                                         "context of 24"):
        dllm.generate(model, ids, sampler=sampler, max_new_tokens=8, attention_mask=mask)


def test_hf_adapters_read_the_context_from_their_config(tmp_path):
    causal = dllm.load(builders.save_causal(tmp_path / "llama"))
    mlm = dllm.load(builders.save_mlm(tmp_path / "bert"))
    assert causal.context_length == 128 and mlm.context_length == 128  # the fixtures' max_position_embeddings
    for model, sampler, prompt in ((causal, "native", 122), (causal, "ar_spec", 122), (mlm, "llada", 121)):
        with pytest.raises(ValueError, match=rf"prompt length {prompt} \+ max_new_tokens 8 = {prompt + 8} tokens "
                                             r"exceeds the model's context of 128"):
            dllm.generate(model, torch.full((1, prompt), 5), sampler=sampler, max_new_tokens=8, temperature=0.0)
    out = dllm.generate(causal, torch.full((1, 121), 5), sampler="native", max_new_tokens=8, temperature=0.0,
                        generator=torch.Generator().manual_seed(0))
    assert out.sequences.shape == (1, 129)  # 128 positions read: the last token is sampled, never fed


def _remote_config(family: str, class_name: str):
    path = REMOTE / family / f"configuration_{family}.py"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    spec = importlib.util.spec_from_file_location(f"configuration_{family}_fixture", path)
    module = importlib.util.module_from_spec(spec)
    with auto_registrations_restored():  # LLaDA's module registers "llada" globally on import
        spec.loader.exec_module(module)
    return getattr(module, class_name)(**json.loads((REMOTE / family / "config.tiny.json").read_text()))


def test_config_context_attributes():
    from transformers import GPT2Config, LlamaConfig

    assert _remote_config("llada", "LLaDAConfig").max_sequence_length == 1024
    assert config_context_length(_remote_config("llada", "LLaDAConfig")) == 1024  # LLaDA: max_sequence_length
    assert config_context_length(_remote_config("dream", "DreamConfig")) == 1024  # Dream: max_position_embeddings
    assert config_context_length(GPT2Config(n_positions=77)) == 77
    assert config_context_length(LlamaConfig(max_position_embeddings=99)) == 99
    try:
        from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig
    except ImportError:
        return
    text = DiffusionGemmaTextConfig(max_position_embeddings=333)
    assert config_context_length(DiffusionGemmaConfig(text_config=text.to_dict())) == 333  # the text config's

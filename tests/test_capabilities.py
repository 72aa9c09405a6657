"""The declared Capabilities record: what adapters declare, what bare models get, and that samplers read it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import dllm
from dllm.models.oracle import HMMOracle
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.protocols import Capabilities, capabilities

from model_stubs import Replaying

SAMPLERS_DIR = Path(__file__).resolve().parents[1] / "samplers"


def _tiny(layout: str) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(vocab_size=12, dim=16, n_layers=1, n_heads=2, max_seq_len=32, layout=layout,
                                           block_size=2 if layout == "block_causal" else None,
                                           mask_token_id=None if layout == "causal" else 11))


@pytest.mark.parametrize("layout", ["causal", "bidirectional", "block_causal"])
def test_transformer_declares_its_record(layout):
    caps = capabilities(_tiny(layout))
    assert caps == Capabilities(accepts_attention_mask=True, context_length=32,
                                block_size=2 if layout == "block_causal" else None, cache=True,
                                cache_exact=layout != "bidirectional", cache_crop=True, cache_drop=True,
                                commits_prefix=True, structured_verify=True, hidden_states=True,
                                tree_attention=layout == "causal", logits_at=True, packs_copies=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.cache = False


def test_an_instance_flag_changes_its_declared_record():
    model = _tiny("bidirectional")
    model.accepts_attention_mask, model.padding_note = False, "its remote code ignores attention_mask"
    caps = capabilities(model)
    assert not caps.accepts_attention_mask and caps.padding_note == "its remote code ignores attention_mask"


def test_bare_logits_function_gets_the_default_record():
    assert capabilities(HMMOracle.random()) == Capabilities()
    assert capabilities(lambda ids: ids) == Capabilities()


def test_undeclared_model_gets_its_documented_attributes_once():
    """A model written against the documented attributes (no record) keeps its powers."""
    caps = capabilities(Replaying(HMMOracle.random()))
    assert caps.cache and caps.cache_crop and not caps.cache_drop and not caps.cache_exact  # it declares none
    assert not caps.structured_verify and not caps.native_loop and caps.block_size is None

    class Sized:
        block_size, context_length, needs_prompt = 4, True, 1  # a bool is no size; truthy flags are flags

    caps = capabilities(Sized())
    assert caps.block_size == 4 and caps.context_length is None and caps.needs_prompt


def test_samplers_read_the_record_not_the_methods():
    """A model that has the methods but declares them off is used without them (and refused where needed)."""
    model = _tiny("block_causal")
    plain = _tiny("block_causal")
    type_ = type("Undeclared", (TransformerLM,), {"capabilities": property(
        lambda self: dataclasses.replace(TransformerLM.capabilities.fget(self), cache=False, structured_verify=False))})
    model.__class__ = type_
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="needs a model with structured_verify"):
        dllm.generate(model, prompt, sampler="fef", max_new_tokens=4, verifier="structured", generator=_g())
    with pytest.raises(ValueError, match="cache='block' needs a model with new_cache"):
        dllm.generate(model, prompt, sampler="fef", max_new_tokens=4, cache="block", generator=_g())
    undeclared = dllm.generate(model, prompt, sampler="fef", max_new_tokens=4, temperature=1.0, generator=_g())
    uncached = dllm.generate(plain, prompt, sampler="fef", max_new_tokens=4, temperature=1.0, generator=_g(),
                             cache="none")
    cached = dllm.generate(plain, prompt, sampler="fef", max_new_tokens=4, temperature=1.0, generator=_g())
    assert torch.equal(undeclared.sequences, uncached.sequences)
    assert undeclared.stats.nfe == uncached.stats.nfe != cached.stats.nfe  # cache='auto' ran without the cache


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(3)


def test_no_sampler_probes_a_model_with_getattr():
    """Samplers read ``capabilities(model)``; getattr/hasattr on a model (or drafter) is an undeclared contract."""
    found = []
    for path in sorted(SAMPLERS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in ("getattr", "hasattr"):
                subject = ast.unparse(node.args[0])
                if "model" in subject or "drafter" in subject:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found

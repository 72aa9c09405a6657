"""Per-sampler frozen configs: defaults written once, validate(model, max_new_tokens), exactness per run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dllm
from dllm import defaults
from dllm.models.oracle import HMMOracle, OracleCausalView
from dllm.models.transformer import TransformerConfig, TransformerLM
from dllm.samplers import SAMPLERS
from dllm.samplers.ar_spec import ArSpecConfig
from dllm.samplers.baselines import FastDllmConfig, LladaConfig
from dllm.samplers.fef import FefConfig
from dllm.samplers.sequential import SequentialConfig


def _block_causal(block_size=2) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(vocab_size=12, dim=16, n_layers=1, n_heads=2, max_seq_len=32,
                                           layout="block_causal", block_size=block_size, mask_token_id=11))


def test_registry_maps_each_name_to_its_config_and_options_come_from_its_fields():
    for name, spec in SAMPLERS.items():
        assert list(spec.options) == [f.name for f in dataclasses.fields(spec.config)], name
        config = spec.config()  # every option has its default, written once on the field
        assert {k: o.default for k, o in spec.options.items()} == config.values(), name
    assert (FefConfig().window, FefConfig().draft) == (defaults.FEF_WINDOW, defaults.FEF_DRAFT)


def _table_of(config) -> dict:
    """The defaults table's entries a config reads: its own and those of the configs it extends."""
    names = {"ArConfig": "ar", "ArSpecConfig": "ar_spec", "BlockConfig": "masked", "LladaConfig": "llada",
             "DreamConfig": "dream", "FastDllmConfig": "fast_dllm", "EbConfig": "eb", "SequentialConfig": "sequential",
             "FefConfig": "fef", "NativeConfig": "native", "SdarConfig": "sdar",
             "Llada2Config": "llada2"}
    table = {}
    for cls in reversed(config.__mro__):
        table.update(defaults.SAMPLER_DEFAULTS.get(names.get(cls.__name__), {}))
    return table


def test_every_option_default_is_the_one_tables_and_the_table_has_no_orphan():
    """dllm.defaults.SAMPLER_DEFAULTS is the one place a sampler option's default is written."""
    used = set()
    for name, spec in SAMPLERS.items():
        table = _table_of(spec.config)
        assert {k: o.default for k, o in spec.options.items()} == table, name
        used |= {(family, option) for family, entries in defaults.SAMPLER_DEFAULTS.items() for option in entries
                 if option in spec.options and table.get(option) is entries[option]}
    assert used == {(family, option) for family, entries in defaults.SAMPLER_DEFAULTS.items() for option in entries}


def test_a_window_longer_than_the_block_is_said_not_silently_capped():
    model = _block_causal(block_size=4)
    with pytest.warns(UserWarning, match=r"window=6 is longer than block_length=4: .*capped"):
        FefConfig(window=6).validate(model, max_new_tokens=8)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FefConfig(window=4).validate(model, max_new_tokens=8)  # a window that fits says nothing


def test_validate_fills_model_dependent_defaults_and_stays_frozen():
    config = FefConfig(window=3).validate(_block_causal(), max_new_tokens=8)
    assert isinstance(config, FefConfig) and (config.block_length, config.window) == (2, 3)  # the model's blocks
    assert FefConfig().validate(HMMOracle.random(), max_new_tokens=6).block_length == 6  # max_new_tokens
    assert LladaConfig().validate(HMMOracle.random(), max_new_tokens=6).steps == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.window = 4


def test_sampler_specific_rules_live_in_their_config():
    oracle = HMMOracle.random()
    with pytest.raises(ValueError, match="either threshold or factor"):
        FastDllmConfig(threshold=0.5, factor=1.0).validate(oracle, max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a model with structured_verify"):
        FefConfig(verifier="structured").validate(oracle, max_new_tokens=4)
    with pytest.raises(ValueError, match="cfg_scale > 0 needs full-sequence calls"):
        LladaConfig(cfg_scale=1.0, cache="block").validate(_block_causal(4), max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter must be 'ngram'"):
        ArSpecConfig(drafter="bigram").validate(OracleCausalView(oracle), max_new_tokens=4)
    with pytest.raises(ValueError, match="window must be >= 1"):
        FefConfig(window=0).validate(oracle, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['window'\] for sampler 'sequential'"):
        SAMPLERS["sequential"].configure({"window": 2}, model=oracle, max_new_tokens=4)


@pytest.mark.parametrize("config,exact", [
    (FefConfig(), True), (FefConfig(cache="prefix"), False), (FefConfig(cache="dual"), False),
    (FefConfig(verifier="structured"), False), (SequentialConfig(cache="block"), True), (LladaConfig(), False),
])
def test_exactness_is_the_configs(config, exact):
    assert config.exact is exact


def test_generate_reports_the_configs_exactness():
    model, prompt = _block_causal(4), torch.tensor([[1, 2, 3]])
    for options in ({}, {"cache": "prefix"}, {"verifier": "structured"}):
        out = dllm.generate(model, prompt, max_new_tokens=4, generator=torch.Generator().manual_seed(0), **options)
        assert out.exact is FefConfig(**options).exact, options


def test_a_checkpoint_declares_its_measured_defaults_in_sampler_defaults_json(tmp_path):
    """A TransformerLM folder's sampler_defaults.json is read back, applied where the caller sets nothing, and a
    malformed one is refused naming the file."""
    import torch

    import dllm
    from dllm.models.transformer import TransformerConfig, TransformerLM

    model = TransformerLM(TransformerConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, max_seq_len=32))
    model.sampler_defaults = {"ar_spec": {"num_draft_tokens": 3, "max_ngram": 2}}
    model.save_pretrained(tmp_path / "m")
    loaded = TransformerLM.from_pretrained(tmp_path / "m")
    assert set(loaded.capabilities.sampler_defaults) == {("ar_spec", "num_draft_tokens", 3, ()),
                                                          ("ar_spec", "max_ngram", 2, ())}
    prompt = torch.tensor([[1, 2, 3]])
    out = dllm.generate(loaded, prompt, sampler="ar_spec", max_new_tokens=4, temperature=0.0, num_draft_tokens=2)
    assert out.options["num_draft_tokens"] == 2 and out.options["max_ngram"] == 2  # the caller's value wins
    (tmp_path / "m" / "sampler_defaults.json").write_text('{"ar_spec": 3}')
    with pytest.raises(ValueError, match="sampler_defaults.json"):
        TransformerLM.from_pretrained(tmp_path / "m")

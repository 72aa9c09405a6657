"""The shipped SDAR-layout model (``dllm/weights/sdar``): its start point, the hub export, and its evaluation.

    python -m dllm.train --recipe sdar init configs/sdar.toml runs/sdar_init --source dllm/weights/diffusion
    python -m dllm.train --config configs/sdar.toml --output runs/sdar          # train (blocks anchored at 0)
    python -m dllm.train --recipe sdar export runs/sdar/model dllm/weights/sdar # the hub SDAR folder
    python -m dllm.train --recipe sdar eval dllm/weights/sdar --limit 200 [--sampler fef --option window=4]

``init``: the config's model with ``--source``'s weights (a model without q/k norms) and each layer's
q / k norm gains set to the mean RMS of that layer's query / key heads on one training batch, so the normed
attention starts near the source's scale (gains of 1 start at a held-out loss ~1.6x higher).
``export``: a TransformerLM folder (block_causal, q/k norms, tied embeddings) as SDAR's hub layout: config.json
with ``model_type: "sdar"`` and every key of SDAR's hub config.json (configuration_sdar.py's, plus those its
modelling code reads off the config without a default: ``fuse_cross_entropy`` in every forward; ``ep_size``,
``micro_forward``, ``use_deepep``, ``skip_checkpoint``, ``debug`` of its training code; ``auto_map`` naming its
files, which are not shipped), so the folder runs in SDAR's own code (``tests/test_shipped_sdar.py``),
``generation_config.json`` with the token ids, ``model.safetensors`` under the names ``dllm.models.native``'s
``sdar`` table reads, the tokenizer with its config (mask token named).
``eval``: held-out accuracy of a folder loaded with ``dllm.load`` (``dllm.training.evaluate.heldout_accuracy``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dllm.data.tokenizer import export_tokenizer
from dllm.models.transformer import TransformerLM

# SDAR's hub auto_map: its code's files, placed beside the weights for trust_remote_code (dllm never runs them)
AUTO_MAP = {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}


@torch.no_grad()
def calibrated_start(config_path: str, output: str, source: str = "dllm/weights/diffusion") -> Path:
    """The run's start model: ``source``'s weights, q/k norm gains set to its mean q / k head RMS per layer."""
    from dllm.data.synthetic import PRESETS
    from dllm.training import load_config
    from dllm.training.batches import step_problems, tokenize_problems
    from dllm.training.loop import _batch, build_model, ensure_tokenizer

    config = load_config(config_path, {"train": {"init_from": source}})
    tokenizer = ensure_tokenizer(config)
    model = build_model(config, tokenizer)
    source = TransformerLM.from_pretrained(source, dtype=torch.float32)
    problems = step_problems(config.train.seed, -1, 16, 0, 1, PRESETS[config.data.preset])  # step -1: not trained on
    examples = tokenize_problems(problems, tokenizer, model.config.layout, model.config.block_size,
                                 config.data.answer_length, config.train.block_anchor)
    batch = _batch(model.config, examples, tokenizer, torch.Generator().manual_seed(0), 0.0, config.train.block_anchor)
    scales, hooks = {}, []
    c = source.config
    for i, layer in enumerate(source.layers):
        def hook(module, inputs, out, i=i):
            q, k, _ = out.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1)
            real = batch.attention_mask.any(-1)  # [B, L] non-padding
            scales[i] = [x.unflatten(-1, (-1, c.head_dim))[real].pow(2).mean(-1).sqrt().mean() for x in (q, k)]
        hooks.append(layer.attn.wqkv.register_forward_hook(hook))
    source(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.layers):
        layer.attn.q_norm.weight.fill_(float(scales[i][0]))
        layer.attn.k_norm.weight.fill_(float(scales[i][1]))
    model.save_pretrained(output)
    shutil.copyfile(config.data.tokenizer, Path(output) / "tokenizer.json")
    return Path(output)


def hub_config(model: TransformerLM) -> dict:
    """SDAR-4B-Chat's config.json keys for ``model``, scaled down, with block_size and the mask id named (the native
    loader reads both, SDAR's training path too). ``fuse_cross_entropy`` is false: SDAR's fused loss needs Triton on
    a GPU (it matters only when training). No ``attn_implementation``: the training repository's flex_attention
    cannot take the dense block mask ``block_diffusion_generate`` passes."""
    c = model.config
    if c.layout != "block_causal" or not c.qk_norm or c.qkv_bias or c.shift_logits or c.rotary_dim != c.head_dim \
            or c.moe is not None:
        raise ValueError("an SDAR export needs a block_causal TransformerLM with q/k norms, no q/k/v biases, "
                         "unshifted logits, full rotary and dense MLPs")
    return {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", "auto_map": AUTO_MAP,
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 3, "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id, "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": c.dim, "initializer_range": 0.02,
        "intermediate_size": c.mlp_hidden, "max_position_embeddings": c.max_seq_len, "max_window_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_hidden_layers": c.n_layers, "num_key_value_heads": c.n_kv_heads,
        "rms_norm_eps": c.norm_eps, "rope_scaling": None, "rope_theta": c.rope_theta, "sliding_window": None,
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": "float32", "use_cache": False,
        "use_sliding_window": False, "vocab_size": c.vocab_size,
        "fuse_cross_entropy": False, "ep_size": 1, "micro_forward": False, "use_deepep": False,
        "skip_checkpoint": False, "debug": False,
    }


def generation_config(model: TransformerLM) -> dict:
    """generation_config.json's token ids (no sampling settings: the samplers' defaults are dllm's)."""
    c = model.config
    return {"bos_token_id": 3, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}


def hub_state(model: TransformerLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under SDAR's hub names (the inverse of ``dllm.models.native``'s sdar table)."""
    c = model.config
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    state = {name: t.detach().float().contiguous() for name, t in model.state_dict().items()}
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(c.n_layers):
        ours, hub = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.wqkv.weight"].split([q_dim, kv_dim, kv_dim])
        gate, up = state[ours + "mlp.w13.weight"].split([c.mlp_hidden, c.mlp_hidden])
        out.update({
            hub + "input_layernorm.weight": state[ours + "attn_norm.weight"],
            hub + "self_attn.q_proj.weight": q, hub + "self_attn.k_proj.weight": k, hub + "self_attn.v_proj.weight": v,
            hub + "self_attn.q_norm.weight": state[ours + "attn.q_norm.weight"],
            hub + "self_attn.k_norm.weight": state[ours + "attn.k_norm.weight"],
            hub + "self_attn.o_proj.weight": state[ours + "attn.wo.weight"],
            hub + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"],
            hub + "mlp.gate_proj.weight": gate, hub + "mlp.up_proj.weight": up,
            hub + "mlp.down_proj.weight": state[ours + "mlp.w2.weight"],
        })
    return {name: t.contiguous().clone() for name, t in out.items()}


def export_sdar(folder: str | Path, output: str | Path, tokenizer: str | Path | None = None) -> Path:
    """A trained TransformerLM folder (config.json, model.safetensors, tokenizer.json) as a hub SDAR folder."""
    folder, output = Path(folder), Path(output)
    model = TransformerLM.from_pretrained(folder, dtype=torch.float32)
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(hub_config(model), indent=2) + "\n")
    (output / "generation_config.json").write_text(json.dumps(generation_config(model), indent=2) + "\n")
    save_file(hub_state(model), str(output / "model.safetensors"), metadata={"format": "pt"})
    export_tokenizer(Path(tokenizer) if tokenizer else folder, output)
    return output


def evaluate_folder(folder: str, sampler: str, limit: int, options: dict, max_new_tokens: int = 80,
                    batch_size: int = 64) -> dict:
    """Held-out accuracy of a model folder as ``dllm.load`` loads it (native SDAR for a hub SDAR folder)."""
    import dllm
    from dllm.training.evaluate import default_sampler, heldout_accuracy

    model = dllm.load(folder)
    name, defaults = default_sampler(model)
    if sampler and sampler != name:
        name, defaults = sampler, {k: v for k, v in defaults.items() if k == "block_length"}
    defaults.update(options)
    return heldout_accuracy(model, model.tokenizer, name, limit=limit, max_new_tokens=max_new_tokens,
                            batch_size=batch_size, progress=sys.stderr.isatty(), **defaults)



def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dllm train --recipe sdar", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="the run's start point, q/k norm gains calibrated")
    init.add_argument("config")
    init.add_argument("output")
    init.add_argument("--source", default="dllm/weights/diffusion")
    export = sub.add_parser("export", help="a trained TransformerLM folder as a hub SDAR folder")
    export.add_argument("folder")
    export.add_argument("output")
    evaluation = sub.add_parser("eval", help="held-out accuracy of a folder loaded with dllm.load")
    evaluation.add_argument("folder")
    evaluation.add_argument("--sampler", default="")
    evaluation.add_argument("--limit", type=int, default=500)
    evaluation.add_argument("--max-new-tokens", type=int, default=80)
    evaluation.add_argument("--batch-size", type=int, default=64)
    evaluation.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    evaluation.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.command == "init":
        print(calibrated_start(args.config, args.output, args.source))
    elif args.command == "export":
        print(export_sdar(args.folder, args.output))
    else:
        from dllm.train import _option  # the --option reader of `dllm train --eval`

        report = evaluate_folder(args.folder, args.sampler, args.limit, dict(map(_option, args.option)),
                                 args.max_new_tokens, args.batch_size)
        report["model"] = args.folder
        text = json.dumps(report, indent=1, default=str)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
    return 0

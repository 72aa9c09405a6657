"""The training loop: AdamW + warmup/cosine, bf16 autocast, clipping, held-out loss, exact resume, accelerate.

Runs the same under ``python -m dllm.train`` and ``accelerate launch --multi_gpu --num_processes N -m
dllm.train`` (on a CPU-only machine that starts N gloo processes; ``--cpu`` alone starts one): every
process builds the same model (DDP keeps it in sync), takes a disjoint shard of each step's batch, and the
loss is normalised by the global token count so the update does not depend on the number of processes (up
to float summation order, and masking noise, which is seeded per process).

Checkpoints (``<output>/checkpoint.pt``, written atomically) hold the model, optimizer and scheduler state,
the RNG states, the step and the log history; since data order and masking noise are pure functions of
``(seed, step)``, a resumed run continues exactly where the checkpoint left off.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dllm.data.synthetic import PRESETS, heldout_set
from dllm.data.tokenizer import load_tokenizer, train_tokenizer, training_corpus
from dllm.models.transformer import TransformerLM
from dllm.training.batches import (
    IGNORE,
    Batch,
    batch_tokens,
    build_batch,
    derive_seed,
    micro_batches,
    step_problems,
    tokenize_problems,
)
from dllm.training.config import RunConfig

CHECKPOINT = "checkpoint.pt"
MODEL_DIR = "model"


def ensure_tokenizer(config: RunConfig):
    """Load ``data.tokenizer``, training it on the synthetic training stream first if the file is missing."""
    path = Path(config.data.tokenizer)
    if not path.exists():
        texts = training_corpus(config.data.tokenizer_corpus, seed=0, config=PRESETS[config.data.preset])
        train_tokenizer(texts, config.data.tokenizer_vocab_size, path)
    return load_tokenizer(path)


def build_model(config: RunConfig, tokenizer) -> TransformerLM:
    """The run's starting model sized to the tokenizer: seeded random init, or ``train.init_from``'s weights.

    ``init_from`` may hold another layout's weights (same shapes): a diffusion model started from an AR
    model, as Dream 7B starts from Qwen2.5; the layout only changes the attention mask.
    """
    model_config = config.model_config(len(tokenizer), tokenizer.mask_token_id, tokenizer.eos_token_id,
                                       tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(config.train.seed, "init") % 2**31)
        model = TransformerLM(model_config)
    if config.train.init_from:
        source = TransformerLM.from_pretrained(config.train.init_from, dtype=torch.float32)
        try:
            missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
        except RuntimeError as exc:
            raise ValueError(f"train.init_from={config.train.init_from!r} does not fit [model]: {exc}") from None
        # a source without q/k norms may start a qk_norm model: those gains keep their init (1)
        missing = [name for name in missing if not name.endswith((".q_norm.weight", ".k_norm.weight"))]
        if missing or unexpected:
            raise ValueError(f"train.init_from={config.train.init_from!r} does not fit [model]: missing {missing}, "
                             f"unexpected {unexpected}")
    return model


def lr_factor(step: int, config: RunConfig) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at the last step."""
    opt = config.train
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    progress = (step - opt.warmup_steps) / max(1, opt.steps - opt.warmup_steps)
    return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(model: TransformerLM, config: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = config.train
    return torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=opt.lr, betas=(opt.beta1, opt.beta2))


def batch_loss(model, batch: Batch, precision: str, device: torch.device) -> torch.Tensor:
    """Sum of weighted cross-entropy over the batch's targets (normalise by ``batch.count`` outside)."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        logits = model(batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                       position_ids=None if batch.position_ids is None else batch.position_ids.to(device),
                       block_offset=batch.block_offset if isinstance(batch.block_offset, int)
                       else batch.block_offset.to(device))
    targets = batch.targets.to(device)
    where = targets != IGNORE
    ce = F.cross_entropy(logits[where].float(), targets[where], reduction="none")
    return (ce * batch.weights.to(device)[where]).sum()


@torch.no_grad()
def heldout_loss(model, config: RunConfig, tokenizer, rank: int = 0, world: int = 1,
                 device: torch.device | str = "cpu") -> tuple[float, int]:
    """(weighted CE sum, token count) of this process's share of the first ``eval_problems`` held-out ones.

    The masking noise is fixed (seeded by the run seed), so successive evaluations are comparable.
    """
    model_config = _unwrap(model).config
    problems = heldout_set()[:config.train.eval_problems][rank::world]
    anchor = config.train.block_anchor
    examples = tokenize_problems(problems, tokenizer, model_config.layout, model_config.block_size,
                                 config.data.answer_length, anchor)
    total, count = 0.0, 0
    for j, chunk in enumerate(micro_batches(examples, config.train.micro_batch_size)):
        generator = torch.Generator().manual_seed(derive_seed(config.train.seed, "eval", rank, j))
        batch = _batch(model_config, chunk, tokenizer, generator, 0.0, anchor)  # the plain objective, always
        total += float(batch_loss(model, batch, config.train.precision, torch.device(device)))
        count += batch.count
    return total, count


def _batch(model_config, examples, tokenizer, generator, suffix_prob: float, anchor: str = "answer") -> Batch:
    return build_batch(model_config.layout, examples, pad_id=tokenizer.pad_token_id,
                       mask_id=model_config.mask_token_id, block_size=model_config.block_size,
                       generator=generator, suffix_prob=suffix_prob, anchor=anchor)


def _unwrap(model):
    return getattr(model, "module", model)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file, then ``os.replace``: a kill never leaves half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _rng_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def train(config: RunConfig, output: str | Path, *, resume: bool = False, stop_at_step: int | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Train (or resume) a run into ``output``; returns the summary also written to ``metrics.json``.

    ``stop_at_step`` ends the run early at that step with a checkpoint, as if killed (the schedule still
    follows ``train.steps``). The final model goes to ``<output>/model`` (config, safetensors, tokenizer).
    """
    from accelerate import Accelerator  # imported here: only training needs it

    torch.set_flush_denormal(True)  # denormals in bf16/fp32 CPU kernels are several times slower
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world, device = accelerator.num_processes, accelerator.device
    opt = config.train
    if opt.batch_size % world:
        raise ValueError(f"train.batch_size={opt.batch_size} must be divisible by the {world} processes")
    output = Path(output)
    with accelerator.main_process_first():
        tokenizer = ensure_tokenizer(config)
    model = build_model(config, tokenizer)
    optimizer = _optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    start, history = 0, []
    checkpoint = output / CHECKPOINT
    if resume and checkpoint.exists():
        start, history = _load_checkpoint(checkpoint, config, model, optimizer, scheduler)
    model = model.to(device)
    model, optimizer = accelerator.prepare(model, optimizer)
    end = min(opt.steps, stop_at_step if stop_at_step is not None else opt.steps)
    show = progress and accelerator.is_main_process
    bar = tqdm(range(start, end), initial=start, total=opt.steps, disable=not show, dynamic_ncols=True)
    seen = next((h["tokens"] for h in reversed(history) if "tokens" in h), 0)
    wall = next((h["wall_s"] for h in reversed(history) if "wall_s" in h), 0.0)  # over resumes
    tokens, tick = 0, time.perf_counter()
    for step in bar:
        loss, n_tokens = _train_step(model, optimizer, accelerator, config, tokenizer, step)
        scheduler.step()
        tokens, seen = tokens + n_tokens, seen + n_tokens
        done = step + 1
        if done % opt.log_every == 0 or done % opt.checkpoint_every == 0 or done == end:
            elapsed = time.perf_counter() - tick
            rate, wall = tokens / max(1e-9, elapsed), wall + elapsed
            history.append({"step": done, "loss": loss, "lr": scheduler.get_last_lr()[0], "tokens": seen,
                            "tokens_per_s": rate, "wall_s": wall})
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
            if not progress and accelerator.is_main_process:
                print(json.dumps(history[-1]), flush=True)
            tokens, tick = 0, time.perf_counter()
        if (opt.eval_every and done % opt.eval_every == 0) or done == opt.steps:
            history.append({"step": done, **_evaluate(model, accelerator, config, tokenizer)})
            if accelerator.is_main_process:
                bar.write(json.dumps(history[-1]))
        if done % opt.checkpoint_every == 0 or done == end:
            if accelerator.is_main_process:
                save_checkpoint(checkpoint, _checkpoint_state(accelerator.unwrap_model(model), optimizer,
                                                              scheduler, done, history, config))
            accelerator.wait_for_everyone()
    bar.close()
    summary = _summary(config, history, accelerator.unwrap_model(model), end)
    if accelerator.is_main_process and end == opt.steps:
        _export(accelerator.unwrap_model(model), Path(config.data.tokenizer), output, summary)
    accelerator.wait_for_everyone()
    return summary


def _train_step(model, optimizer, accelerator, config: RunConfig, tokenizer, step: int) -> tuple[float, int]:
    """One optimizer step over this process's micro-batches; returns (global mean loss, tokens seen)."""
    opt, model_config = config.train, _unwrap(model).config
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    problems = step_problems(opt.seed, step, opt.batch_size, rank, world, PRESETS[config.data.preset])
    examples = tokenize_problems(problems, tokenizer, model_config.layout, model_config.block_size,
                                 config.data.answer_length, opt.block_anchor)
    chunks = micro_batches(examples, opt.micro_batch_size)
    generators = [torch.Generator().manual_seed(derive_seed(opt.seed, "noise", step, rank, j))
                  for j in range(len(chunks))]
    batches = [_batch(model_config, chunk, tokenizer, g, opt.suffix_mask_prob, opt.block_anchor)
               for chunk, g in zip(chunks, generators)]
    global_count = _reduce_sum(accelerator, float(sum(b.count for b in batches)))
    loss_sum, tokens = 0.0, 0
    model.train()
    for j, batch in enumerate(batches):
        sync = j == len(batches) - 1
        with contextlib.nullcontext() if sync else accelerator.no_sync(model):
            loss = batch_loss(model, batch, opt.precision, device)
            # DDP averages gradients over processes: scale so the update is d(global sum)/global count.
            accelerator.backward(loss * world / global_count)
        loss_sum += float(loss.detach())
        tokens += batch_tokens(batch)
    if opt.grad_clip > 0:
        accelerator.clip_grad_norm_(model.parameters(), opt.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _reduce_sum(accelerator, loss_sum) / global_count, int(_reduce_sum(accelerator, float(tokens)))


def _reduce_sum(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(tensor, reduction="sum")[0])


def _evaluate(model, accelerator, config: RunConfig, tokenizer) -> dict[str, float]:
    """Held-out loss over all processes and, if configured, greedy accuracy (main process)."""
    model.eval()
    total, count = heldout_loss(model, config, tokenizer, accelerator.process_index, accelerator.num_processes,
                                accelerator.device)
    result = {"eval_loss": _reduce_sum(accelerator, total) / _reduce_sum(accelerator, float(count))}
    if config.train.eval_accuracy_problems:
        from dllm.training.evaluate import default_sampler, heldout_accuracy

        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            sampler, options = default_sampler(unwrapped)
            report = heldout_accuracy(unwrapped, tokenizer, sampler, limit=config.train.eval_accuracy_problems,
                                      max_new_tokens=config.data.answer_length, **options)
            result["eval_accuracy"] = report["accuracy"]
        accelerator.wait_for_everyone()
    model.train()
    return result


def _checkpoint_state(model, optimizer, scheduler, step: int, history, config: RunConfig) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": step, "history": history, "rng": _rng_states(), "config": config.to_dict()}


def _load_checkpoint(path: Path, config: RunConfig, model, optimizer, scheduler) -> tuple[int, list]:
    """Restore everything from ``path``; refuses a checkpoint made with another model or data config."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state["config"]
    for table in ("model", "data"):
        if saved[table] != config.to_dict()[table]:
            raise ValueError(f"{path} was written with a different [{table}] config: {saved[table]}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state["step"], state["history"]


def _summary(config: RunConfig, history: list[dict], model, steps: int) -> dict[str, Any]:
    losses = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    return {"steps": steps, "processes": _world(), "params": _unwrap(model).param_count(),
            "final_loss": losses[-1]["loss"] if losses else None,
            "final_eval": evals[-1] if evals else None, "config": config.to_dict(), "history": history}


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _export(model, tokenizer_path: Path, output: Path, summary: dict[str, Any]) -> None:
    """The finished model as ``<output>/model`` (config.json, model.safetensors, the tokenizer's files)."""
    from dllm.data.tokenizer import export_tokenizer

    folder = output / MODEL_DIR
    model.save_pretrained(folder)
    export_tokenizer(tokenizer_path, folder)
    (output / "metrics.json").write_text(json.dumps(summary, indent=1) + "\n")

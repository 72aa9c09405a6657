"""``dllm train --recipe prefix-conditioned``: the block-wise any-order objective of the two-stream layout.

    python -m dllm.train --recipe prefix-conditioned --config configs/prefix_conditioned.toml \\
        --init dllm/weights/diffusion --output runs/two_stream
    accelerate launch --multi_gpu --num_processes 8 -m dllm.train --recipe prefix-conditioned \\
        --config CONFIG --init /path/to/LLaDA-8B-Instruct --native llada --output runs/llada_two_stream

Per example: the prompt is the content stream's start, in order; the answer region (answer, EOS, EOS
padding to whole blocks plus one EOS block, as the block-diffusion recipe lays it out) follows block by
block, left to right, in a random order inside each block (``prefix.left_to_right_prob`` of the blocks in
position order: the states left-to-right decoding visits). One forward scores every region token by a
query that sees the prompt and the tokens revealed before it: the exact log-likelihood of the region
under that order, i.e. the chain ``sequential`` samples (dllm/models/two_stream.py). The loss is its mean
over region tokens. Data order and noise are pure functions of (seed, step, process), as in
``dllm.training.batches``. ``[prefix] pairs = FILE_OR_DATASET`` trains on prompt-response pairs instead
(dllm/training/pairs.py: the FeF paper's data shape, chat-templated prompts). The loop runs under
accelerate (CPU processes here, GPUs for a LLaDA or Dream checkpoint read by ``dllm/models/native.py``).
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from dllm.data.synthetic import PRESETS, heldout_set
from dllm.models.transformer import TransformerLM
from dllm.models.two_stream import TwoStreamLM
from dllm.training.batches import IGNORE, Example, derive_seed, micro_batches, step_problems, tokenize_problems
from dllm.training.config import config_from_dict
from dllm.training.loop import _optimizer, lr_factor


@dataclass(frozen=True)
class PrefixConfig:
    """The recipe's own settings (``[prefix]``): region blocks and the share of in-order blocks."""

    block_size: int = 8
    left_to_right_prob: float = 0.5
    # Prompt-response pairs (dllm/training/pairs.py) instead of the synthetic stream: a data file or a hub
    # dataset name; None trains on ``data.preset``'s problems.
    pairs: str | None = None
    prompt_field: str = "prompt"
    response_field: str = "response"
    chat_template: bool = True  # prompts through the tokenizer's chat template, where it has one
    max_tokens: int = 2048  # longer pairs (prompt + answer region) are dropped at load

    def __post_init__(self) -> None:
        if self.pairs is not None and (not isinstance(self.pairs, str) or not self.pairs):
            raise ValueError(f"prefix.pairs must be a data file or a dataset name, got {self.pairs!r}")
        for name in ("prompt_field", "response_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"prefix.{name} must be a column name, got {getattr(self, name)!r}")
        if not isinstance(self.chat_template, bool):
            raise ValueError(f"prefix.chat_template must be true or false, got {self.chat_template!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            raise ValueError(f"prefix.max_tokens must be an int >= 2, got {self.max_tokens!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"prefix.block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.left_to_right_prob, int | float) or not 0 <= self.left_to_right_prob <= 1:
            raise ValueError(f"prefix.left_to_right_prob must be in [0, 1], got {self.left_to_right_prob!r}")


@dataclass
class StreamBatch:
    """Inputs of ``TwoStreamLM.streams`` for a batch, and the query targets."""

    content_ids: Tensor  # [B, C]
    content_pos: Tensor  # [B, C]
    content_valid: Tensor  # [B, C]
    query_pos: Tensor  # [B, Q]
    query_sees: Tensor  # [B, Q]
    targets: Tensor  # [B, Q] token ids or IGNORE
    count: int  # region tokens (the loss normaliser)


def reveal_order(region: int, block_size: int, generator: torch.Generator, in_order_prob: float) -> list[int]:
    """Region offsets in reveal order: blocks left to right, a random permutation inside each block."""
    order: list[int] = []
    for start in range(0, region, block_size):
        size = min(block_size, region - start)
        in_order = float(torch.rand((), generator=generator)) < in_order_prob
        perm = range(size) if in_order else torch.randperm(size, generator=generator).tolist()
        order += [start + i for i in perm]
    return order


def build_stream_batch(examples: list[Example], *, pad_id: int, block_size: int, generator: torch.Generator,
                       in_order_prob: float) -> StreamBatch:
    """Content [prompt, region in reveal order]; one query per region token, seeing what came before it."""
    rows = []
    for e in examples:
        p, order = len(e.prompt), reveal_order(len(e.region), block_size, generator, in_order_prob)
        ids = list(e.prompt) + [e.region[i] for i in order]
        pos = list(range(p)) + [p + i for i in order]
        rows.append((ids, pos, [p + i for i in order], [p + k for k in range(len(order))],
                     [e.region[i] for i in order]))
    width = max(len(r[0]) for r in rows)
    queries = max(len(r[2]) for r in rows)

    def pad(values, size, fill):
        return torch.tensor([v + [fill] * (size - len(v)) for v in values], dtype=torch.long)

    return StreamBatch(pad([r[0] for r in rows], width, pad_id), pad([r[1] for r in rows], width, 0),
                       pad([[1] * len(r[0]) for r in rows], width, 0).bool(), pad([r[2] for r in rows], queries, 0),
                       pad([r[3] for r in rows], queries, 0), pad([r[4] for r in rows], queries, IGNORE),
                       sum(len(e.region) for e in examples))


def stream_loss(model: TwoStreamLM, batch: StreamBatch, precision: str, device: torch.device) -> Tensor:
    """Summed cross-entropy of the region tokens under their reveal order (normalise by ``batch.count``)."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        logits = model.streams(batch.content_ids.to(device), batch.content_pos.to(device),
                               batch.content_valid.to(device), batch.query_pos.to(device), batch.query_sees.to(device))
    targets = batch.targets.to(device)
    where = targets != IGNORE
    return F.cross_entropy(logits[where].float(), targets[where], reduction="sum")


def load_init(path: str, native: str | None) -> TwoStreamLM:
    """The starting weights: a project model folder, or a LLaDA/Dream checkpoint through native.py."""
    if native:
        from dllm.models.native import load_native

        # NativeLM is loaded for inference (no gradients); its layers are the ones trained here.
        return TwoStreamLM(load_native(path, native, dtype=torch.float32).requires_grad_(True))
    return TwoStreamLM(TransformerLM.from_pretrained(path, dtype=torch.float32))


def read_config(path: str, overrides: list[str]):
    """(RunConfig with [data]/[train], PrefixConfig) from the TOML file plus ``table.key=value`` overrides."""
    with open(path, "rb") as f:
        values = tomllib.load(f)
    for item in overrides:
        name, _, text = item.partition("=")
        table, _, key = name.partition(".")
        try:
            parsed = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = text
        values.setdefault(table, {})[key] = parsed
    prefix = values.pop("prefix", {})
    allowed = [f.name for f in fields(PrefixConfig)]
    unknown = sorted(set(prefix) - set(allowed))
    if unknown:
        raise ValueError(f"unknown [prefix] keys {unknown}; allowed keys: {allowed}")
    return config_from_dict(values), PrefixConfig(**prefix)


def heldout_stream_loss(model, run, prefix: PrefixConfig, tokenizer, device, examples=None) -> float:
    """Mean region-token loss, left to right (fixed): on ``examples`` (held-out pairs), else on the first
    ``eval_problems`` held-out synthetic problems."""
    if examples is None:
        problems = heldout_set()[:run.train.eval_problems]
        examples = tokenize_problems(problems, tokenizer, "block_causal", prefix.block_size, run.data.answer_length)
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in micro_batches(examples, run.train.micro_batch_size):
            batch = build_stream_batch(chunk, pad_id=tokenizer.pad_token_id, block_size=prefix.block_size,
                                       generator=torch.Generator().manual_seed(0), in_order_prob=1.0)
            total += float(stream_loss(model, batch, "fp32", device))
            count += batch.count
    return total / count


def train(run, prefix: PrefixConfig, init: str, output: str, native: str | None = None) -> dict:
    """Fine-tune ``init`` with the objective; saves ``output/model`` (a TwoStreamLM folder) and a log."""
    from accelerate import Accelerator  # only training needs it

    from dllm.data.tokenizer import load_tokenizer

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    tokenizer_path = Path(init) / "tokenizer.json"
    model = load_init(init, native).train()
    if native:  # the checkpoint's own tokenizer (a transformers one) tokenizes the data
        tokenizer = model.base.tokenizer
    else:
        tokenizer = load_tokenizer(tokenizer_path if tokenizer_path.exists() else run.data.tokenizer)
    opt = run.train
    optimizer = _optimizer(model, run)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, run))
    model, optimizer = accelerator.prepare(model, optimizer)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    log, start = [], time.time()
    inner = accelerator.unwrap_model(model)
    pairs = None
    if prefix.pairs is not None:
        from dllm.training.pairs import load_pairs

        pairs = load_pairs(prefix.pairs, tokenizer, block_size=prefix.block_size, max_tokens=prefix.max_tokens,
                           prompt_field=prefix.prompt_field, response_field=prefix.response_field,
                           chat_template=prefix.chat_template)
        # The last eval_problems pairs are held out (never trained on) for the logged held-out loss.
        pairs, heldout_pairs = pairs.split(min(opt.eval_problems, len(pairs.examples) // 2))
        if accelerator.is_main_process:
            epochs = opt.steps * opt.batch_size / len(pairs.examples)
            print(json.dumps({"pairs": len(pairs.examples), "dropped_longer_than_max_tokens": pairs.dropped,
                              "epochs": round(epochs, 3)}), flush=True)
    for step in range(opt.steps):
        if pairs is not None:
            examples = pairs.step_examples(opt.seed, step, opt.batch_size, rank, world)
        else:
            problems = step_problems(opt.seed, step, opt.batch_size, rank, world, PRESETS[run.data.preset])
            examples = tokenize_problems(problems, tokenizer, "block_causal", prefix.block_size,
                                         run.data.answer_length)
        chunks = micro_batches(examples, opt.micro_batch_size)
        # The batch's region tokens over all processes: every process divides by the same count.
        total = int(accelerator.reduce(torch.tensor(sum(len(e.region) for e in examples), device=device), "sum"))
        loss_sum = 0.0
        for j, chunk in enumerate(chunks):
            generator = torch.Generator().manual_seed(derive_seed(opt.seed, "order", step, rank, j) % 2**63)
            batch = build_stream_batch(chunk, pad_id=tokenizer.pad_token_id, block_size=prefix.block_size,
                                       generator=generator, in_order_prob=prefix.left_to_right_prob)
            loss = stream_loss(inner, batch, opt.precision, device)
            accelerator.backward(loss / total)
            loss_sum += float(loss.detach())
        if opt.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if accelerator.is_main_process and ((step + 1) % opt.log_every == 0 or step + 1 == opt.steps):
            entry = {"step": step + 1, "loss": loss_sum / (total / world), "minutes": (time.time() - start) / 60}
            if (step + 1) % opt.eval_every == 0 or step + 1 == opt.steps:
                inner.eval()
                entry["heldout_loss"] = heldout_stream_loss(inner, run, prefix, tokenizer, device,
                                                            (heldout_pairs or None) if pairs is not None else None)
                inner.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if accelerator.is_main_process and (step + 1) % opt.checkpoint_every == 0:
            _export(inner, tokenizer_path, out, log)
    if accelerator.is_main_process:
        _export(inner, tokenizer_path, out, log)
    accelerator.wait_for_everyone()
    return {"steps": opt.steps, "log": log}


def _export(model: TwoStreamLM, tokenizer_path: Path, out: Path, log: list) -> None:
    """Write ``out/model`` (weights, config, marker, tokenizer) and ``out/log.json``."""
    model.eval()
    model.save_pretrained(out / "model")
    if tokenizer_path.exists():
        from dllm.data.tokenizer import export_tokenizer

        export_tokenizer(tokenizer_path, out / "model")
    (out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    model.train()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dllm train --recipe prefix-conditioned",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/prefix_conditioned.toml")
    parser.add_argument("--init", required=True, help="model folder to start from (e.g. dllm/weights/diffusion)")
    parser.add_argument("--native", choices=("llada", "dream"), help="read --init as a hub checkpoint of this family")
    parser.add_argument("--output", default="runs/two_stream")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args(argv)
    run, prefix = read_config(args.config, args.set)
    train(run, prefix, args.init, args.output, args.native)
    return 0


"""A `dllm` model for lm-evaluation-harness: any checkpoint `dllm.load` reads, decoded by any dllm sampler.

    dllm-lm-eval run --model dllm --model_args pretrained=PATH,sampler=fef,window=4,block_length=32 --tasks gsm8k
    # the same: python -m dllm.eval.lm_eval_plugin run ...; plain `lm_eval --model dllm` cannot find the model
    # in Python: import dllm.eval.lm_eval_plugin, then lm_eval.simple_evaluate(model="dllm", ...)

lm-eval (0.4.x) finds models only in its own registry: it reads no entry points, so the class must be
registered by importing this module before lm-eval looks the name up. `main` does that, then runs
lm-eval's own command line with the same arguments.

model_args: `pretrained` (default: the shipped model for the sampler's kind), `kind`, `dtype`, `device`,
`sampler`, `temperature` (used when a request sets none), `max_gen_toks`, `seed`, `batch_size`,
`mc_samples` and `mc_batch_size` (Monte-Carlo samples for diffusion log-likelihoods, and how many go
in one call), `add_bos_token`, `max_length`; every other key is a sampler option (`window=4`,
`drafter=PATH` for ar_spec), read by the option's type as on dllm's command line (`cache=none` stays a string).

Requests:
- `generate_until`: `until` stop strings (plus the EOS text) and `max_gen_toks` from the request's
  gen_kwargs; `do_sample=False` (or temperature 0) decodes greedily, else at the request's temperature.
  With `block_length` set, the token budget is rounded up to whole blocks and the answer cut back.
- `loglikelihood`: exact for causal models (sum of next-token log-probabilities); for diffusion models
  the Monte-Carlo ELBO of LLaDA (Nie et al. 2025, eq. 6 and Appendix B.6): mask l ~ U{1..n} of the n
  continuation tokens, weight the masked tokens' log-probabilities by n / l, average over `mc_samples`.
  It is a lower bound of the log-likelihood, noisy with few samples; `is_greedy` is whether greedy
  `sequential` decoding reproduces the continuation.
- `loglikelihood_rolling` (perplexity tasks): causal models only; diffusion models raise.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

import dllm
from dllm.defaults import DTYPE, TEMPERATURE, resolve_dtype
from dllm.eval.answers import truncate_at_stop
from dllm.eval.runner import batch_seed, default_model, left_pad, model_device
from dllm.protocols import is_causal_model
from dllm.samplers import SAMPLERS, typed_options

__all__ = ["DllmLM", "main"]

logger = logging.getLogger(__name__)
_LM_EVAL_KEYS = ("max_batch_size",)  # passed by lm-eval's CLI to every model; not ours


@register_model("dllm")
class DllmLM(TemplateLM):
    """lm-eval's LM interface over `dllm.load` and `dllm.generate`."""

    def __init__(self, pretrained: str | None = None, kind: str = "auto", dtype: str | None = DTYPE,
                 device: str | None = None, sampler: str = "fef", temperature: float = TEMPERATURE,
                 max_gen_toks: int = 256, seed: int = 0, batch_size: int | str = 1, mc_samples: int = 32,
                 mc_batch_size: int = 32, add_bos_token: bool = False, max_length: int | None = None,
                 **sampler_options: Any) -> None:
        super().__init__()
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {sorted(SAMPLERS)}, got {sampler!r}")
        for key in _LM_EVAL_KEYS:
            sampler_options.pop(key, None)
        device = _available(device)
        dtype = resolve_dtype(dtype, device)
        sampler_options = typed_options(sampler, sampler_options)
        self.model = dllm.load(pretrained or default_model(sampler), kind=kind, device=device, dtype=dtype)
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer; lm-eval passes text")
        self.sampler, self.temperature, self.max_gen_toks = sampler, float(temperature), int(max_gen_toks)
        self.seed, self.mc_samples, self.mc_batch_size = int(seed), int(mc_samples), int(mc_batch_size)
        self.add_bos_token = bool(add_bos_token)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # "auto" is not supported
        self._max_length = max_length
        drafter = sampler_options.get("drafter")
        if isinstance(drafter, str) and drafter != "ngram":
            sampler_options["drafter"] = dllm.load(drafter, device=device, dtype=dtype)
        self.options = sampler_options
        self.causal = is_causal_model(self.model)
        self._device = model_device(self.model)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DllmLM:
        """``--model_args`` text: our own keywords typed as lm-eval types them, sampler options as text for
        ``typed_options`` (lm-eval would turn ``1e3`` into a float and ``true`` into a bool for any key)."""
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "sampler_options"}
        args: dict[str, Any] = {}
        for item in filter(str.strip, (arg_string or "").split(",")):
            key, _, value = item.partition("=")
            key = key.strip()
            args[key] = lm_utils.handle_arg_string(value) if key in own or key in _LM_EVAL_KEYS else value
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**args, **extra})

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        eos = self.model.eos_token_id
        return int(eos if eos is not None else self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int | None:
        """The longest sequence the model takes (None when its config does not say)."""
        if self._max_length is not None:
            return int(self._max_length)
        config = getattr(self.model, "config", None)
        for name in ("max_seq_len", "max_position_embeddings", "max_sequence_length"):
            if getattr(config, name, None):
                return int(getattr(config, name))
        return None

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special)["input_ids"]

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "dllm")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ---------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Batches of requests that share gen_kwargs, each decoded by one `dllm.generate` call."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="dllm generate_until")
        for indices in groups.values():
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                contexts = [requests[i].args[0] for i in batch]
                texts = self._generate(contexts, requests[batch[0]].args[1])
                for i, context, text in zip(batch, contexts, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
                bar.update(len(batch))
        bar.close()
        return results

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = dict(gen_kwargs)
        until = _stop_strings(kwargs.pop("until", None), self.tokenizer.decode([self.eot_token_id]))
        budget = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", self.max_gen_toks)))
        temperature = float(kwargs.pop("temperature", self.temperature))
        if not kwargs.pop("do_sample", temperature > 0):
            temperature = 0.0
        if kwargs:
            _warn_once(f"dllm ignores these gen_kwargs (samplers take their options from model_args): {sorted(kwargs)}")
        steps = _round_up(budget, self.options.get("block_length") or 1)
        prompts = [self._truncate(self.tok_encode(c), steps) for c in contexts]
        input_ids, mask = left_pad(prompts, self._pad_id(), self._device)
        generator = torch.Generator(device=self._device).manual_seed(batch_seed(self.seed, contexts[0]))
        with torch.inference_mode():
            out = dllm.generate(self.model, input_ids, sampler=self.sampler, max_new_tokens=steps,
                                temperature=temperature, generator=generator, attention_mask=mask, **self.options)
        answers = out.sequences[:, input_ids.shape[1]:input_ids.shape[1] + budget].tolist()
        return [truncate_at_stop(self._decode(a), until) for a in answers]

    def _truncate(self, ids: list[int], new_tokens: int) -> list[int]:
        """Keep the end of a context that would not fit with the answer (as lm-eval's HF model does)."""
        if self.max_length is None:
            return ids
        return ids[-max(1, self.max_length - new_tokens):]

    def _decode(self, answer: list[int]) -> str:
        stops = set(getattr(self.model, "stop_token_ids", None) or [self.eot_token_id])
        cut = next((i for i, t in enumerate(answer) if t in stops), len(answer))
        return self.tokenizer.decode(answer[:cut], skip_special_tokens=True)

    def _pad_id(self) -> int:
        pad = getattr(self.model, "pad_token_id", None)
        return int(pad if pad is not None else self.tokenizer.pad_token_id or self.eot_token_id)

    # ---------------------------------------------------------------- likelihoods

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        score = self._causal_loglikelihood if self.causal else self._diffusion_loglikelihood
        results = []
        for key, context, continuation in tqdm(requests, disable=disable_tqdm, desc="dllm loglikelihood"):
            result = score(context, continuation)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    @torch.inference_mode()
    def _causal_loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Exact: sum of log p(continuation token | everything before it)."""
        ids = torch.tensor([context + continuation], device=self._device)
        logits = self.model(ids[:, :-1])[0, len(context) - 1:]  # [n, V]: positions predicting the continuation
        log_probs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation, device=self._device)
        total = log_probs.gather(1, target[:, None]).sum()
        return float(total), bool((log_probs.argmax(dim=-1) == target).all())

    @torch.inference_mode()
    def _diffusion_loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """LLaDA's Monte-Carlo ELBO over `mc_samples` random maskings of the continuation."""
        n, start = len(continuation), len(context)
        generator = torch.Generator(device=self._device).manual_seed(batch_seed(self.seed, str(context + continuation)))
        clean = torch.tensor(context + continuation, device=self._device)
        target = clean[start:]
        total = 0.0
        for first in range(0, self.mc_samples, self.mc_batch_size):
            rows = min(self.mc_batch_size, self.mc_samples - first)
            counts = torch.randint(1, n + 1, (rows,), generator=generator, device=self._device)  # [R] masked
            ranks = torch.rand(rows, n, generator=generator, device=self._device).argsort(dim=1)
            masked = ranks < counts[:, None]  # [R, n]: a uniform subset of `count` positions per row
            noisy = clean.repeat(rows, 1)
            noisy[:, start:][masked] = self.model.mask_token_id
            log_probs = F.log_softmax(self._diffusion_logits(noisy, start)[:, start:].float(), dim=-1)
            token_lp = log_probs.gather(2, target.expand(rows, n)[..., None])[..., 0]  # [R, n]
            total += float(((token_lp * masked).sum(dim=1) * n / counts).sum())
        return total / self.mc_samples, self._greedy_reproduces(context, continuation)

    def _diffusion_logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        if getattr(self.model, "block_size", None) is not None:  # blocks start at the answer (dllm.protocols)
            offset = torch.full((ids.shape[0],), start, device=ids.device)
            return self.model(ids, block_offset=offset)
        return self.model(ids)

    def _greedy_reproduces(self, context: list[int], continuation: list[int]) -> bool:
        """Whether greedy one-token-per-call decoding (the exact samplers' T=0 output) gives the continuation."""
        out = dllm.generate(self.model, torch.tensor([context], device=self._device), sampler="sequential",
                            max_new_tokens=len(continuation), temperature=0.0, eos_token_id=None,
                            order=self.options.get("order", "left_to_right"))
        return out.sequences[0, len(context):].tolist() == continuation

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity-style scores over rolling windows (causal models only)."""
        if not self.causal:
            raise NotImplementedError(
                "loglikelihood_rolling (perplexity tasks such as wikitext) needs a causal model: a diffusion "
                "model has no exact token-by-token likelihood, and an ELBO over long documents is not offered. "
                "Use generate_until or loglikelihood (multiple-choice) tasks with diffusion models.")
        if self.max_length is None:
            raise ValueError("loglikelihood_rolling needs max_length (pass max_length= in model_args)")
        scores = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="dllm loglikelihood_rolling"):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            scores.append(sum(self._causal_loglikelihood(c, t)[0] for c, t in windows))
        return scores


def _stop_strings(until, eos_text: str) -> list[str]:
    """The request's stop strings as a list, plus the EOS text (lm-eval's convention)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    return stops + [eos_text] if eos_text and eos_text not in stops else stops


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _available(device: str | None) -> str | None:
    """The device to load on: lm-eval's command line asks for cuda:0 by default, even on CPU-only machines."""
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %s requested but CUDA is not available; using the CPU", device)
        return None
    return device


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the `dllm` model registered: `python -m dllm.eval.lm_eval_plugin run ...`."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())

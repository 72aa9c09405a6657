"""A `dllm` model for lm-evaluation-harness: any checkpoint `dllm.load` reads, decoded by any dllm sampler.

    dllm-lm-eval run --model dllm --model_args pretrained=PATH,sampler=fef,window=4,block_length=32 --tasks gsm8k
    python -m dllm.eval.lm_eval_plugin run --model dllm --model_args pretrained=PATH,sampler=ar --tasks hellaswag
    # plain `lm_eval --model dllm` cannot find the model (lm-eval reads no entry points; see below)
    # in Python: import dllm.eval.lm_eval_plugin, then lm_eval.simple_evaluate(model="dllm", ...)

lm-eval (0.4.x) finds models only in its own registry: it reads no entry points, so the class must be
registered by importing this module before lm-eval looks the name up. `main` does that, then runs
lm-eval's own command line with the same arguments.

On a causal model with sampler=ar (or ar_spec, greedy) the numbers are those of lm-eval's `hf` backend
(HFLM): the same BOS rule (the tokenizer's default, skipped when the text already starts with BOS, as
chat-templated prompts do; `add_bos_token` overrides), the same prefix token for empty contexts and
rolling windows (BOS, else EOS; `prefix_token_id` overrides), the same left truncation, request order and
batches, and the same stop rule (the checkpoint's generation_config EOS, then the `until` strings).

model_args (checked when the model is built; an unknown key is refused naming the allowed ones):
`pretrained` (default: the shipped model for the sampler's kind), `kind`, `dtype` (default `auto`: as in
lm-eval's `hf` backend, the checkpoint's own dtype, so `--model dllm` and `--model hf` load alike; this
differs from dllm's own command lines, where `auto` is bf16 where the device computes it natively;
`float32`, `bfloat16`, `float16` convert), `device` (default: CUDA when available, else the CPU),
`revision`, `trust_remote_code`, `sampler` (default: ar for a causal model, fef for a diffusion one),
`temperature` (used when a request sets none), `max_gen_toks`, `seed`, `batch_size` (an int or "auto";
given in model_args it wins over `--batch_size`), `max_batch_size` (the ceiling of "auto"),
`add_bos_token`, `prefix_token_id`, `max_length`, and for diffusion models `loglikelihood`, `mc_samples`,
`mc_batch_size`, `check_greedy` (below); every other key must be an option of the chosen sampler (`window=4`,
`drafter=PATH` for ar_spec), read by the option's type as on dllm's command line (`cache=none` stays a
string).

Requests:
- `generate_until`: `until` stop strings (plus the EOS text) and `max_gen_toks` from the request's
  gen_kwargs; `do_sample=False` (or temperature 0) decodes greedily, else at the request's temperature.
  With `block_length` set, the token budget is rounded up to whole blocks and the answer cut back.
- `loglikelihood`: exact for causal models (sum of next-token log-probabilities, batched as HFLM does).
  For diffusion models, model_args `loglikelihood=exact` scores the continuation under the left-to-right chain
  the exact samplers sample (`dllm.score`: one call over copies on a bidirectional model, one per block with the
  exact block cache on a block-causal one; requests of equal continuation length batched, contexts left-padded),
  and `is_greedy` is whether every token is its conditional's most likely one, read from the same call: the law
  scored, the law sampled and the law `is_greedy` judges are one. The default, `loglikelihood=elbo`, is what
  LLaDA's published scores use: the Monte-Carlo ELBO of LLaDA (Nie et al. 2025, eq. 6, Appendix B.6): mask
  l ~ U{1..n} of the n continuation tokens, weight the masked tokens' log-probabilities by n / l, average
  over `mc_samples` (default 32) maskings drawn from a generator seeded by (`seed`, request). A
  block-causal model is scored block by block as it was trained: block b is noised alone, after the clean
  blocks before it, with the positions past the continuation masked. Cost: mc_samples x (number of blocks)
  model calls' worth of rows per request, `mc_batch_size` rows per call. It is a lower bound, noisy with
  few samples: its standard error (over the samples) is logged per task and kept in `elbo_stderr`.
  `is_greedy` is whether greedy `sequential` decoding reproduces the continuation: one more decode of n
  model calls per request; `check_greedy=False` skips it and reports False. Which method ran is logged and kept
  in `loglikelihood_method`.
- `loglikelihood_rolling` (perplexity tasks): lm-eval's rolling windows (prefix token, `max_length`);
  causal models score them exactly, diffusion models with the same ELBO per window.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm.auto import tqdm

import dllm
from dllm.defaults import DTYPE, TEMPERATURE, resolve_dtype
from dllm.eval.runner import batch_seed, default_model, left_pad, model_device
from dllm.protocols import context_length, is_causal_model
from dllm.samplers import SAMPLERS, typed_options

__all__ = ["DllmLM", "main"]

# A child of lm-eval's logger, so messages appear where lm-eval's own do (its CLI configures "lm_eval").
logger = logging.getLogger("lm_eval.models.dllm")
DEFAULT_MAX_LENGTH = 2048  # HFLM's default when neither config nor tokenizer names a length
OWN_KEYS = ("pretrained", "kind", "dtype", "device", "revision", "trust_remote_code", "sampler", "temperature",
            "max_gen_toks", "seed", "batch_size", "max_batch_size", "add_bos_token", "prefix_token_id",
            "max_length", "loglikelihood", "mc_samples", "mc_batch_size", "check_greedy")
LOGLIKELIHOODS = ("elbo", "exact")  # a diffusion model's loglikelihood: LLaDA's Monte-Carlo ELBO, or dllm.score


class DllmLM(TemplateLM):
    """lm-eval's LM interface over `dllm.load` and `dllm.generate`."""

    def __init__(self, pretrained: str | None = None, kind: str = "auto", dtype: str | None = DTYPE,
                 device: str | None = None, revision: str | None = None, trust_remote_code: bool | None = None,
                 sampler: str | None = None, temperature: float = TEMPERATURE, max_gen_toks: int = 256, seed: int = 0,
                 batch_size: int | str = 1, max_batch_size: int | None = 64, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, max_length: int | None = None, loglikelihood: str = "elbo",
                 mc_samples: int = 32, mc_batch_size: int = 32, check_greedy: bool = True,
                 **sampler_options: Any) -> None:
        super().__init__()
        if sampler is not None:
            _check_keys(sampler, sampler_options)
        self.temperature = _number("temperature", temperature, 0.0)
        self.max_gen_toks = _int("max_gen_toks", max_gen_toks, 1)
        self.seed = _int("seed", seed, 0)
        self.mc_samples = _int("mc_samples", mc_samples, 1)
        self.mc_batch_size = _int("mc_batch_size", mc_batch_size, 1)
        self.max_batch_size = 64 if max_batch_size is None else _int("max_batch_size", max_batch_size, 1)
        self._batch_size = _batch_size(batch_size)
        self._max_length = None if max_length is None else _int("max_length", max_length, 2)
        self.custom_prefix_token_id = None if prefix_token_id is None else _int("prefix_token_id", prefix_token_id, 0)
        self.add_bos_token = _flag("add_bos_token", add_bos_token, optional=True)
        self.check_greedy = _flag("check_greedy", check_greedy)
        if loglikelihood not in LOGLIKELIHOODS:
            raise ValueError(f"model_args loglikelihood must be one of {list(LOGLIKELIHOODS)}, got {loglikelihood!r}")
        load_kw = {k: v for k, v in (("revision", revision), ("trust_remote_code", trust_remote_code)) if v is not None}
        if _own_checkpoint(pretrained, kind):  # this project's folders run no remote code and have no revisions
            load_kw = {}
        device = _pick_device(device)
        dtype = _checkpoint_dtype(dtype, device)
        self.model = dllm.load(pretrained or default_model(sampler or "fef"), kind=kind, device=device, dtype=dtype,
                               **load_kw)
        self.causal = is_causal_model(self.model)
        # what scores a loglikelihood request: exact for a causal model, the chosen method for a diffusion one
        self.loglikelihood_method = "exact" if self.causal else loglikelihood
        if sampler is None:  # the model's plain sampler: lm-eval's numbers for causal models, fef for diffusion
            sampler = "ar" if self.causal else "fef"
            _check_keys(sampler, sampler_options)
        spec = SAMPLERS[sampler]
        if spec.model_kind != "any" and (spec.model_kind == "causal") != self.causal:
            fitting = sorted(n for n, o in SAMPLERS.items() if o.model_kind in ("any", _kind(self.causal)))
            raise ValueError(f"model_args sampler={sampler!r} needs a {spec.model_kind} model; {pretrained} is a "
                             f"{_kind(self.causal)} model (its samplers: {fitting})")
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"model_args pretrained={pretrained} has no tokenizer; lm-eval passes text")
        if self.add_bos_token is not None:  # as HFLM, which loads its tokenizer with add_bos_token=: the
            self.tokenizer.add_bos_token = self.add_bos_token  # default of add_special_tokens changes too
        self.sampler = sampler
        sampler_options = typed_options(sampler, sampler_options)  # text values read by each option's type
        drafter = sampler_options.get("drafter")
        if isinstance(drafter, str) and drafter != "ngram":
            sampler_options["drafter"] = dllm.load(drafter, device=device, dtype=dtype)
        self.options = sampler_options
        self._device = model_device(self.model)
        self._stops = self._generation_stops()
        budget = _round_up(self.max_gen_toks, self.options.get("block_length") or 1)
        spec.resolve(self.options, model=self.model, max_new_tokens=budget)  # bad values raise now, naming the option
        self._auto_batch_size: int | None = None
        self.elbo_stderr: list[float] = []  # per diffusion log-likelihood request, in the order scored

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DllmLM:
        """As lm-eval's, except that a key in model_args wins over the same key from the command line, and sampler
        options stay text for ``typed_options`` (lm-eval would turn ``none`` into None and ``1e3`` into a float
        for any key, whatever the option expects)."""
        args: dict[str, Any] = {}
        for item in filter(str.strip, (arg_string or "").split(",")):
            key, _, value = item.partition("=")
            key = key.strip()
            args[key] = lm_utils.handle_arg_string(value) if key in OWN_KEYS else value
        return cls.create_from_arg_obj(args, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> DllmLM:
        # lm-eval passes batch_size (its --batch_size, default 1), max_batch_size and device to every model;
        # the base class's merge raises TypeError when model_args names one of them too.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ---------------------------------------------------------------- tokens and sizes

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else self.model.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context and each rolling window: BOS if the tokenizer has one, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """The longest input: model_args, else the model's declared context, else the tokenizer's, else 2048."""
        if self._max_length is not None:
            return self._max_length
        declared = context_length(self.model)  # the one reading of a model's context (samplers and eval use it)
        if declared is not None:
            return declared
        return resolve_max_length(None, self.tokenizer, default=DEFAULT_MAX_LENGTH)  # lm-eval's fallbacks

    @property
    def batch_size(self) -> int:
        """model_args' batch size; "auto": the largest (<= max_batch_size) whose max_length forward fits."""
        if self._batch_size != "auto":
            return self._batch_size
        if self._auto_batch_size is None:
            self._auto_batch_size = self._detect_batch_size()
            logger.info("batch_size=auto: %d", self._auto_batch_size)
        return self._auto_batch_size

    def _detect_batch_size(self) -> int:
        """Shrink-and-retry on out-of-memory from max_batch_size (accelerate's helper, as HFLM uses), probing one
        max_length call per size."""
        from accelerate.utils import find_executable_batch_size

        @find_executable_batch_size(starting_batch_size=self.max_batch_size)
        def probe(batch_size: int) -> int:
            ids = torch.full((batch_size, self.max_length), self._pad_id(), device=self._device)
            with torch.inference_mode():
                self.model(ids)
            return batch_size

        return probe()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """HFLM's rule: the tokenizer's default specials (or add_bos_token), none if the text starts with BOS."""
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = False
        ids = self.tokenizer.encode(string, **({} if special is None else {"add_special_tokens": special}))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _encode_prompt(self, string: str) -> list[int]:
        """A generation prompt: as HFLM's batch encoder, which checks the tokenizer's bos_token text."""
        special = False if has_bos_prefix(string, self.tokenizer.bos_token) else self.add_bos_token
        return self.tokenizer.encode(string, **({} if special is None else {"add_special_tokens": special}))

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "dllm")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def _pad_id(self) -> int:
        pad = getattr(self.model, "pad_token_id", None)
        return int(pad if pad is not None else self.tokenizer.pad_token_id or self.eot_token_id)

    # ---------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests sorted and batched as HFLM does (longest first, same gen_kwargs), one `dllm.generate` each."""
        collator = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                            group_by="gen_kwargs", group_fn=lambda a: a[1])
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="dllm generate_until")
        results = []
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            for context, text in zip(contexts, self._generate(list(contexts), all_kwargs[0])):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                bar.update(1)
        bar.close()
        return collator.get_original(results)

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), self.tokenizer.decode([self.eot_token_id]))
        budget = int(kwargs.pop("max_gen_toks"))
        kwargs.pop("do_sample")
        kwargs.pop("temperature", None)
        # A request that names no temperature gets model_args' (default 0: greedy, as HFLM); do_sample=False is greedy.
        temperature = float(gen_kwargs.get("temperature", self.temperature))
        temperature = 0.0 if gen_kwargs.get("do_sample") is False else temperature
        if kwargs:
            _warn_once(f"dllm ignores these gen_kwargs (samplers take their options from model_args): {sorted(kwargs)}")
        steps = _round_up(budget, self.options.get("block_length") or 1)
        if self.max_length - steps < 1:
            raise ValueError(f"max_gen_toks={budget} (rounded up to {steps} for whole blocks) must be less than "
                             f"max_length={self.max_length}")
        prompts = [self._encode_prompt(c)[-(self.max_length - steps):] for c in contexts]  # keep the end, as HFLM
        input_ids, mask = left_pad(prompts, self._pad_id(), self._device)
        generator = torch.Generator(device=self._device).manual_seed(batch_seed(self.seed, contexts[0]))
        with torch.inference_mode():
            out = dllm.generate(self.model, input_ids, sampler=self.sampler, max_new_tokens=steps,
                                temperature=temperature, generator=generator, attention_mask=mask,
                                eos_token_id=self._stops or "model", **self.options)
        answers = out.sequences[:, input_ids.shape[1]:input_ids.shape[1] + budget].tolist()
        return [postprocess_generated_text(self._decode(a), until, None) for a in answers]

    def _generation_stops(self) -> list[int] | None:
        """A transformers causal checkpoint stops where HF generate (HFLM) does: its generation_config's EOS;
        None: dllm.generate's default (the model's stop_token_ids)."""
        config = getattr(getattr(self.model, "model", None), "generation_config", None) if self.causal else None
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            return None
        return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]

    def _decode(self, answer: list[int]) -> str:
        stops = set(self._stops or getattr(self.model, "stop_token_ids", None) or [self.eot_token_id])
        cut = next((i for i, t in enumerate(answer) if t in stops), len(answer))
        return self.tokenizer.decode(answer[:cut], skip_special_tokens=True)

    # ---------------------------------------------------------------- likelihoods

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, greedy: bool = True,
                              **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids) -> (log-likelihood, is_greedy) each;
        greedy=False: is_greedy is not wanted (rolling windows), so diffusion models skip its decode."""
        if not requests:
            return []
        if self.causal:
            return self._causal_loglikelihoods(requests, disable_tqdm)
        if self.loglikelihood_method == "exact":
            return self._chain_loglikelihoods(requests, disable_tqdm)
        logger.info("dllm loglikelihood: LLaDA's Monte-Carlo ELBO (mc_samples=%d; loglikelihood=exact scores the "
                    "exact chain)", self.mc_samples)
        results, errors = [], []
        for key, context, continuation in tqdm(requests, disable=disable_tqdm, desc="dllm loglikelihood (ELBO)"):
            estimate, stderr = self._elbo(context, continuation)
            check = greedy and self.check_greedy
            result = (estimate, check and self._greedy_reproduces(context, continuation))
            errors.append(stderr)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        self.elbo_stderr.extend(errors)
        logger.info("dllm ELBO over %d requests (mc_samples=%d, seed=%d): standard error median %.4f, max %.4f nats",
                    len(errors), self.mc_samples, self.seed, *_median_and_max(errors))
        return results

    @torch.inference_mode()
    def _causal_loglikelihoods(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Exact, batched as HFLM: longest first, right-padded, requests sharing context + continuation[:-1]
        scored once; a request longer than max_length keeps its last max_length + 1 tokens."""
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
                            group_by="contexts", group_fn=lambda r: r[1] + r[2][:-1])
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="dllm loglikelihood")
        results = []
        for chunk in collator.get_batched(n=self.batch_size):
            for _, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise ValueError(f"a loglikelihood request needs a context, and a continuation of 1 to "
                                     f"max_length={self.max_length} tokens; got {len(context)} and {len(continuation)}")
            inputs = [(c + t)[-(self.max_length + 1):][:-1] for _, c, t in chunk]
            width = max(len(i) for i in inputs)
            ids = torch.tensor([i + [self._pad_id()] * (width - len(i)) for i in inputs], device=self._device)
            log_probs = F.log_softmax(self.model(ids).float(), dim=-1)  # [B, width, V]; right padding is never read
            for (key, context, continuation), row, inp in zip(chunk, log_probs, inputs):
                scored = row[len(inp) - len(continuation):len(inp)][None]  # [1, n, V]
                for key_, tokens, lp in collator.get_cache(req_str=key, cxt_toks=context, cont_toks=continuation,
                                                           logits=scored):
                    target = torch.tensor(tokens, device=self._device)
                    lp = lp[0, -len(tokens):]  # [n, V]
                    result = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
                    results.append(result)
                    if key_ is not None:
                        self.cache_hook.add_partial("loglikelihood", key_, result)
                    bar.update(1)
        bar.close()
        return collator.get_original(results)

    @torch.inference_mode()
    def _chain_loglikelihoods(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """``dllm.score`` of each continuation (the exact samplers' chain at temperature 1): requests of equal
        continuation length in batches of ``batch_size``, contexts left-padded (one at a time on a model that
        takes no padding); a context keeps its last tokens within max_length."""
        from dllm.protocols import accepts_attention_mask

        size = self._block_size()
        per_call = self.batch_size if accepts_attention_mask(self.model) else 1
        order = sorted(range(len(requests)), key=lambda i: (len(requests[i][2]), -len(requests[i][1])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        calls = 0
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="dllm loglikelihood (exact chain)")
        while order:
            n = len(requests[order[0]][2])
            group = [i for i in order[:per_call] if len(requests[i][2]) == n]
            order = order[len(group):]
            canvas = _round_up(n, size or 1)
            if not n or canvas >= self.max_length:
                raise ValueError(f"a loglikelihood request needs a continuation of 1 to {self.max_length - 1} tokens "
                                 f"(with its block padding); got {n}")
            contexts = [requests[i][1][-(self.max_length - canvas):] for i in group]
            width = max(map(len, contexts))
            ids = torch.tensor([[self._pad_id()] * (width - len(c)) + c for c in contexts], device=self._device)
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=self._device)
            conts = torch.tensor([requests[i][2] for i in group], device=self._device)
            scored = dllm.score(self.model, ids, conts, attention_mask=mask if not bool(mask.all()) else None,
                                temperature=1.0, eos_token_id=None)
            calls += scored.stats.nfe
            for row, i in enumerate(group):
                results[i] = (float(scored.total[row]), bool(scored.is_greedy[row]))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(group))
        bar.close()
        logger.info("dllm loglikelihood: the exact chain (dllm.score) over %d requests, %d model calls", len(requests),
                    calls)
        return results

    def _block_size(self) -> int | None:
        return getattr(self.model, "block_size", None)  # dllm.protocols: block-causal models declare it

    @torch.inference_mode()
    def _elbo(self, context: list[int], continuation: list[int]) -> tuple[float, float]:
        """LLaDA's Monte-Carlo ELBO of the continuation, block by block for block-causal models
        -> (estimate, its standard error over the mc_samples maskings; nan for one sample)."""
        n, mask_id = len(continuation), self.model.mask_token_id
        size = self._block_size() or n
        padded = _round_up(n, size)
        if padded >= self.max_length:
            raise ValueError(f"a continuation of {n} tokens ({padded} with its block padding) leaves no room for "
                             f"context in max_length={self.max_length}")
        context = context[-(self.max_length - padded):]  # keep the end, as for causal models
        start, blocks = len(context), padded // size
        generator = torch.Generator(device=self._device).manual_seed(batch_seed(self.seed, str(context + continuation)))
        clean = torch.tensor(context + continuation + [mask_id] * (padded - n), device=self._device)  # [start + padded]
        offsets, index = torch.arange(size, device=self._device), torch.arange(len(clean), device=self._device)
        totals = torch.zeros(self.mc_samples, dtype=torch.float64, device=self._device)  # one estimate per masking
        pairs = torch.cartesian_prod(torch.arange(self.mc_samples), torch.arange(blocks)).to(self._device)  # [S*K, 2]
        for chunk in pairs.split(self.mc_batch_size):
            sample, block = chunk[:, 0], chunk[:, 1]  # [R] each
            real = (block[:, None] * size + offsets) < n  # [R, size]: continuation tokens (not block padding)
            length = real.sum(1)
            noise = torch.rand(len(chunk), size + 1, generator=generator, device=self._device, dtype=torch.float64)
            count = (noise[:, 0] * length).long() + 1  # [R]: l ~ U{1..length}
            scores = noise[:, 1:].masked_fill(~real, 2.0)  # [R, size]: the l lowest real positions are masked
            masked = (scores.argsort(1).argsort(1) < count[:, None]) & real  # [R, size]: `count` real positions
            positions = start + block[:, None] * size + offsets  # [R, size]
            later = index >= start + (block[:, None] + 1) * size  # [R, T]: blocks after this one, all masked
            noisy = clean.expand(len(chunk), -1).masked_fill(later, mask_id)
            noisy = noisy.scatter(1, positions, torch.where(masked, mask_id, clean[positions]))
            logits = self._diffusion_logits(noisy, start)  # [R, T, V]
            logits = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))  # [R, size, V]
            token_lp = F.log_softmax(logits.float(), dim=-1).gather(2, clean[positions][..., None])[..., 0]
            token_lp = token_lp.masked_fill(~masked, 0.0)  # unmasked and padding positions (-inf at the mask id)
            totals.index_add_(0, sample, (token_lp.sum(1) * length / count).double())
        stderr = float(totals.std() / math.sqrt(self.mc_samples)) if self.mc_samples > 1 else math.nan
        return float(totals.mean()), stderr

    def _diffusion_logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        if self._block_size() is not None:  # blocks start at the answer (dllm.protocols)
            return self.model(ids, block_offset=torch.full((ids.shape[0],), start, device=ids.device))
        return self.model(ids)

    def _greedy_reproduces(self, context: list[int], continuation: list[int]) -> bool:
        """Whether greedy one-token-per-call decoding (the exact samplers' T=0 output) gives the continuation."""
        size = self._block_size()
        steps = _round_up(len(continuation), size or 1)
        context = context[-max(1, self.max_length - steps):]
        out = dllm.generate(self.model, torch.tensor([context], device=self._device), sampler="sequential",
                            max_new_tokens=steps, temperature=0.0, eos_token_id=None,
                            order=self.options.get("order", "left_to_right"),
                            **({"block_length": size} if size else {}))
        return out.sequences[0, len(context):len(context) + len(continuation)].tolist() == continuation

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity scores: lm-eval's disjoint rolling windows, each scored as a loglikelihood request."""
        # A diffusion window holds its continuation's block padding too, so its windows are that much shorter.
        room = self.max_length if self.causal else self.max_length - 1 - ((self._block_size() or 1) - 1)
        windows, counts = [], []
        for (text,) in [r.args for r in requests]:
            rolling = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=room, context_len=1)))
            windows.extend((None, c, t) for c, t in rolling)
            counts.append(len(rolling))
        scores = [s for s, _ in self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, greedy=False)]
        totals, first = [], 0
        for request, count in zip(requests, counts):
            totals.append(sum(scores[first:first + count]))
            first += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"model_args {name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_keys(sampler: Any, sampler_options: dict) -> None:
    """The sampler exists, and every key that is not the backend's own is one of its options."""
    if sampler not in SAMPLERS:
        raise ValueError(f"model_args sampler must be one of {sorted(SAMPLERS)}, got {sampler!r}")
    unknown = sorted(set(sampler_options) - set(SAMPLERS[sampler].options))
    if unknown:
        raise ValueError(f"unknown model_args key(s) {unknown}: allowed are {list(OWN_KEYS)} and the options "
                         f"of sampler {sampler!r}: {sorted(SAMPLERS[sampler].options)}")


def _own_checkpoint(pretrained: str | None, kind: str) -> bool:
    """Whether `pretrained` is this project's TransformerLM folder (dllm.load takes no hub keywords for it)."""
    from dllm.models.loading import detect_kind

    config = Path(str(pretrained)) / "config.json"
    if kind != "auto" or pretrained is None or not config.is_file():
        return kind == "dllm" or pretrained is None
    return detect_kind(json.loads(config.read_text())) == "dllm"


def _kind(causal: bool) -> str:
    return "causal" if causal else "diffusion"


def _batch_size(value: Any) -> int | str:
    """An int, its digits (lm-eval's --batch_size is a string), "auto", or "auto:N" (here the same as "auto")."""
    if isinstance(value, str) and (value == "auto" or value.startswith("auto:")):
        return "auto"
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model_args batch_size must be an int >= 1, \"auto\" or \"auto:N\", got {value!r}")
    return value


def _number(name: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"model_args {name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def _flag(name: str, value: Any, optional: bool = False) -> bool | None:
    if (value is None and optional) or isinstance(value, bool):
        return value
    raise ValueError(f"model_args {name} must be True or False{' (or unset)' if optional else ''}, got {value!r}")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _median_and_max(values: list[float]) -> tuple[float, float]:
    finite = sorted(v for v in values if not math.isnan(v))  # nan: one sample has no standard error
    return (finite[len(finite) // 2], finite[-1]) if finite else (math.nan, math.nan)


def _checkpoint_dtype(dtype: Any, device: str) -> torch.dtype | None:
    """lm-eval's meaning of model_args dtype: "auto" (and None) keeps the checkpoint's dtype, as HFLM's
    ``torch_dtype="auto"``; a name converts. (dllm's own ``auto`` is ``auto_dtype``: not used here.)"""
    return None if dtype in (None, "auto") else resolve_dtype(dtype, device, "model_args dtype")


def _pick_device(device: str | None) -> str:
    """CUDA when available, else the CPU; lm-eval's command line asks for cuda by default, even on CPU-only hosts."""
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Registered under the module's package name only: run as ``python -m dllm.eval.lm_eval_plugin`` this file is
# also ``__main__``, and the CLI (dllm.eval.lm_eval_cli) then imports it by name, which registers it once.
if __name__ != "__main__":
    register_model("dllm")(DllmLM)


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the `dllm` model registered (``dllm.eval.lm_eval_cli``, the console
    script ``dllm-lm-eval``, which imports nothing heavy before its guard)."""
    from dllm.eval.lm_eval_cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""``dllm.load``: a checkpoint folder or hub id in, a DiffusionModel or CausalModel adapter out."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dllm.defaults import auto_dtype

KINDS = ("auto", "llada", "dream", "sdar", "llada2", "diffusion_gemma", "mlm", "causal", "dllm", "remote")
NATIVE_KINDS = ("llada", "dream", "sdar", "llada2")  # read by dllm.models.native: no file of the checkpoint runs
NATIVE_ONLY = ("sdar", "llada2")  # native kinds without a kind="remote" (dllm never runs their hub code)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
_HUB_KEYS = ("revision", "token", "cache_dir", "local_files_only")  # what reading a hub config.json may need


def load(name_or_path: str | os.PathLike, kind: str = "auto", device: str | torch.device | None = None,
         dtype: torch.dtype | str | None = None, **kw: Any):
    """Load a checkpoint as a dllm model carrying ``.tokenizer`` (None when the checkpoint has none).

    kind: "llada", "dream" (native ``dllm.models.native.NativeLM``: the checkpoint's Python files never run;
    ``trust_remote_code=True`` takes kind "remote" instead), "sdar" (native too: SDAR / TraDo block diffusion,
    ``model_type: sdar``; there is no remote kind for it), "llada2" (native too: LLaDA2.0 / LLaDA2.1 block
    diffusion with experts, ``model_type: llada2_moe``; no remote kind either), "diffusion_gemma" (transformers'
    DiffusionGemmaForBlockDiffusion, see ``DiffusionGemmaAdapter``), "mlm" (``AutoModelForMaskedLM``),
    "causal" (``AutoModelForCausalLM``), "dllm" (this project's TransformerLM folder), "remote" (a LLaDA or
    Dream checkpoint through its own hub code, guarded: see ``dllm.models.remote``; also what
    ``trust_remote_code=True`` asks for on those families) or "auto" (read from config.json: model_type and
    architectures, or our ``layout`` key).
    device, dtype: where and in what precision to load; None keeps CPU and the checkpoint's dtype; dtype "auto"
    is ``dllm.defaults.auto_dtype(device)`` (bf16 only where the device computes it natively).
    kw: ``mask_token_id`` (override, diffusion kinds), ``block_size`` (sdar, llada2: override of the block size,
    else config.json's, else 4 for sdar and 32 for llada2), ``tokenizer`` (a tokenizer, or a path to load one from),
    ``device_map`` (native llada/dream/sdar/llada2: accelerate placement), ``trust_remote_code``; the rest goes to
    ``from_pretrained`` (revision, ...).
    A local folder never reaches the network (local_files_only=True), nor does the bare name of a model this
    package ships (``dllm.load("two_stream")``: ``dllm/weights/two_stream``); a hub id goes to transformers as is,
    except that one neither cached nor reachable fails after one request (``HubUnreachableError``, an OSError).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    dtype = auto_dtype(device) if dtype == "auto" else _check_dtype(dtype)
    local = _local_folder(name_or_path)
    config = _config_dict(name_or_path, local, kw)
    kind = _resolve_kind(kind, detect_kind(config), name_or_path, config, kw)
    if kind == "remote":
        return _load_remote(str(name_or_path), detect_kind(config), local, device, dtype, kw)
    if kind in NATIVE_KINDS:
        from dllm.models.native import load_native  # no file of the checkpoint is imported or run

        if kw.pop("trust_remote_code", None) is True and kind in NATIVE_ONLY:  # (llada/dream took "remote" above)
            name = {"sdar": "SDAR", "llada2": "LLaDA2"}[kind]
            raise ValueError(f"trust_remote_code=True: {name} checkpoints load natively only (dllm never runs their "
                             f"hub code, and has no kind='remote' for them); drop trust_remote_code")
        return load_native(local or str(name_or_path), kind, device, dtype, **kw)
    if kind == "dllm":
        return _load_dllm(local, name_or_path, device, dtype, kw)
    return _load_hf(str(name_or_path), kind, local, device, dtype, kw)


def detect_kind(config: dict) -> str | None:
    """The kind a config.json describes, or None when it does not say."""
    if "layout" in config:
        return "dllm"
    model_type = str(config.get("model_type") or "").lower()
    names = [model_type, *(str(a).lower() for a in config.get("architectures") or [])]
    if any(name.startswith("llada2") for name in names):  # before "llada": llada2_moe, llada21_moe, LLaDA2Moe...
        return "llada2"
    if any(name.startswith("llada") for name in names):
        return "llada"
    if any(name.startswith("dream") for name in names):
        return "dream"
    if any(name.startswith("sdar") for name in names):  # before "causal": SDARForCausalLM is block diffusion
        return "sdar"
    if any(name.startswith(("diffusion_gemma", "diffusiongemma")) for name in names):
        return "diffusion_gemma"
    if any(name.endswith("formaskedlm") for name in names):
        return "mlm"
    if any(name.endswith(("forcausallm", "lmheadmodel")) for name in names):
        return "causal"
    return _kind_from_model_type(model_type)


def _kind_from_model_type(model_type: str) -> str | None:
    """mlm or causal when transformers maps the model_type to only one of the two heads."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    masked, causal = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES, model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return "mlm" if masked and not causal else "causal" if causal and not masked else None


def _resolve_kind(kind: str, detected: str | None, name, config: dict, kw: dict) -> str:
    """The kind to load: the detected one for "auto"; an explicit one must not contradict the config;
    "remote" for kind="remote", or trust_remote_code=True on a LLaDA / Dream checkpoint."""
    from dllm.models.remote import FAMILIES

    what = f"model_type={config.get('model_type')!r}, architectures={config.get('architectures')}"
    allowed = [k for k in KINDS if k != "auto"]
    if kind == "remote":
        if detected not in FAMILIES:
            raise ValueError(f"kind='remote' loads LLaDA or Dream hub code, but {name} is neither ({what}); "
                             f"for other remote code pass kind= one of {[k for k in allowed if k != 'remote']} "
                             f"with trust_remote_code=True")
        return kind
    if kw.get("trust_remote_code") is True and detected in FAMILIES and kind in ("auto", detected):
        return "remote"
    if kind == "auto":
        if detected is None:
            raise ValueError(f"kind='auto' cannot tell what {name} is from its config.json ({what}); "
                             f"pass kind= one of {allowed}")
        return detected
    if detected is not None and detected != kind:
        raise ValueError(f"kind={kind!r} does not match {name}: its config.json ({what}) describes a "
                         f"{detected!r} checkpoint; pass kind={detected!r} or kind='auto'")
    return kind


def _check_dtype(dtype) -> torch.dtype | None:
    """None, a torch dtype, or its name ("bfloat16")."""
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be None, 'auto', a torch.dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return dtype


SHIPPED = Path(__file__).resolve().parents[1] / "weights"  # the models this package ships (their READMEs)


def is_shipped(name_or_path) -> bool:
    """Whether ``name_or_path`` names one of the models this package ships (a bare name or its folder)."""
    try:
        folder = _local_folder(name_or_path)
    except (FileNotFoundError, ValueError):
        return False
    return folder is not None and folder.resolve().parent == SHIPPED


def shipped_or_path(value: str | os.PathLike) -> Path:
    """A folder argument as a Path, where a bare name that is no folder here but names something this package
    ships (a model or a draft head: ``"drafter"``, ``"fef_head"``) is its folder in ``dllm/weights``, from any
    working directory; a folder of that name in the working directory wins."""
    path = Path(value).expanduser()
    if isinstance(value, str) and value not in ("", ".", "..") and path.name == value and not path.exists() \
            and (SHIPPED / value).is_dir():
        return SHIPPED / value
    return path


def _local_folder(name_or_path) -> Path | None:
    """The folder when ``name_or_path`` is one on disk or the bare name of a shipped model (``"diffusion"``,
    ``"two_stream"``, ...: ``dllm/weights/<name>``); None for a hub id; an error for a missing path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    text = str(name_or_path)
    if isinstance(name_or_path, str) and text and "/" not in text and (SHIPPED / text / "config.json").is_file():
        kind = json.loads((SHIPPED / text / "config.json").read_text()).get("kind")
        if kind is not None:  # a shipped draft head (its config names its kind), not a model
            raise ValueError(f"name_or_path {text!r} is a shipped draft head ({kind}), not a model: pass it "
                             f"as draft_head={text!r}")
        return SHIPPED / text
    if isinstance(name_or_path, os.PathLike) or str(name_or_path).startswith((".", "/", "~")) or path.exists():
        raise FileNotFoundError(f"name_or_path {str(name_or_path)!r} is not a folder (nor a hub id)")
    return None


def _config_dict(name_or_path, local: Path | None, kw: dict) -> dict:
    """config.json as a dict, without running any remote code."""
    if local is not None:
        file = local / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{local} has no config.json")
        return json.loads(file.read_text())
    from transformers import PretrainedConfig

    check_hub_reachable(str(name_or_path), kw)
    config, _ = PretrainedConfig.get_config_dict(str(name_or_path), **{k: kw[k] for k in _HUB_KEYS if k in kw})
    return config


class HubUnreachableError(OSError):
    """A hub id whose files are not in the local cache, and the hub could not be reached (``reason``: why)."""

    def __init__(self, name: str, endpoint: str, reason: str):
        super().__init__(f"name_or_path {name!r}: not in the local hub cache, and the hub ({endpoint}) could not "
                         f"be reached ({reason})")
        self.reason = f"the hub ({endpoint}) could not be reached: {reason}"


def check_hub_reachable(name: str, kw: dict, repo_type: str = "model", filename: str = "config.json") -> None:
    """Fail fast, after one request, when hub id ``name`` is neither cached nor reachable: huggingface_hub
    would retry the connection five times with backoff (about 25 s of warnings) before the same failure.

    No request when the hub is off (HF_HUB_OFFLINE, ``local_files_only``) or ``filename`` is cached (the model's
    config; a dataset's card, which ``datasets`` reads first); an answer from the hub (not found, gated) or a
    malformed id is left to the load, which reports it as before.
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE or kw.get("local_files_only"):
        return
    try:
        cached = try_to_load_from_cache(name, filename, cache_dir=kw.get("cache_dir"), revision=kw.get("revision"),
                                        repo_type=repo_type)
        if isinstance(cached, str):
            return  # on a failed connection huggingface_hub falls back to the cache without retrying
        get_hf_file_metadata(hf_hub_url(name, filename, repo_type=repo_type, revision=kw.get("revision")),
                             token=kw.get("token"))
    except (HfHubHTTPError, ValueError, TypeError):
        return
    except Exception as error:  # no answer at all: name resolution, refused connection, timeout, proxy, TLS
        raise HubUnreachableError(name, constants.ENDPOINT, " ".join(str(error).split()) or type(error).__name__
                                  ) from None


def _load_dllm(local: Path | None, name, device, dtype, kw: dict):
    """The project's TransformerLM with the folder's tokenizer.json (and chat template) attached as ``.tokenizer``."""
    from dllm.data.tokenizer import load_tokenizer
    from dllm.models.chat import folder_chat_template
    from dllm.models.transformer import TransformerLM

    tokenizer = kw.pop("tokenizer", None)
    if kw:
        raise TypeError(f"kind='dllm' takes only the keyword tokenizer=, got {sorted(kw)}")
    if local is None:
        raise ValueError(f"kind='dllm' needs a local folder, got {str(name)!r}")
    from dllm.models.two_stream import TwoStreamLM, is_two_stream_folder

    model = (TwoStreamLM if is_two_stream_folder(local) else TransformerLM).from_pretrained(local, device, dtype)
    if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
        file = Path(tokenizer) if tokenizer is not None else local / "tokenizer.json"
        tokenizer = load_tokenizer(file) if file.is_file() else None
        if tokenizer is not None:  # the chat template its folder declares, as transformers reads a hub folder's
            tokenizer.chat_template = folder_chat_template(file.parent)
    model.tokenizer = tokenizer
    return model


def _load_hf(name: str, kind: str, local: Path | None, device, dtype, kw: dict):
    """A transformers checkpoint wrapped in the adapter for its kind."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    from dllm.models.diffusion_gemma import DiffusionGemmaAdapter
    from dllm.models.hf import CausalLMAdapter, DreamAdapter, LLaDAAdapter, MaskedLMAdapter

    auto_class, adapter = {
        "llada": (AutoModel, LLaDAAdapter),
        "dream": (AutoModel, DreamAdapter),
        "diffusion_gemma": (_diffusion_gemma_class(), DiffusionGemmaAdapter),
        "mlm": (AutoModelForMaskedLM, MaskedLMAdapter),
        "causal": (AutoModelForCausalLM, CausalLMAdapter),
    }[kind]
    if auto_class is None:
        import transformers

        raise ImportError(f"kind={kind!r} needs a transformers with DiffusionGemmaForBlockDiffusion "
                          f"(installed: {transformers.__version__})")
    trust = kw.pop("trust_remote_code", kind in ("llada", "dream"))
    mask_token_id = kw.pop("mask_token_id", None)
    if mask_token_id is not None and kind == "causal":
        raise TypeError("mask_token_id= is for diffusion kinds (llada, dream, diffusion_gemma, mlm), not kind='causal'")
    if local is not None:
        kw["local_files_only"] = True
    tokenizer = _load_tokenizer(kw.pop("tokenizer", None), name, local, trust, kw)
    model = auto_class.from_pretrained(name, dtype=dtype or "auto", device_map=device, trust_remote_code=trust, **kw)
    if kind == "causal":
        return adapter(model, tokenizer)
    return adapter(model, tokenizer, mask_token_id)


def _load_remote(name: str, family: str, local: Path | None, device, dtype, kw: dict):
    """A LLaDA / Dream checkpoint through its own code: known transformers-5 failures become one clear
    RemoteCodeError; a model with tensors the folder lacks, or rotary tables off their formula, is refused."""
    from dllm.models.remote import check_rotary, check_weights, guard

    kw["trust_remote_code"] = True
    with guard(name, family):
        adapter = _load_hf(name, family, local, device, dtype, kw)
    folder = local if local is not None else _hub_snapshot(name, kw)
    if folder is not None:
        check_weights(adapter.model, folder, name)
    check_rotary(adapter.model, adapter.model.config, name)
    return adapter


def _hub_snapshot(name: str, kw: dict) -> Path | None:
    """The cached snapshot folder from_pretrained just read for hub id ``name`` (no download), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    hub = {k: kw[k] for k in ("revision", "token", "cache_dir") if k in kw}
    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"], local_files_only=True, **hub))
    except LocalEntryNotFoundError:  # not in the cache as such: no tensor names to check against
        return None


def _diffusion_gemma_class():
    """The class with the LM head (AutoModel maps diffusion_gemma to the headless DiffusionGemmaModel)."""
    try:
        from transformers import DiffusionGemmaForBlockDiffusion
    except ImportError:
        return None  # an older transformers: loading this kind then fails with a clear message
    return DiffusionGemmaForBlockDiffusion


def _load_tokenizer(given, name: str, local: Path | None, trust: bool, kw: dict):
    """``given`` if it is a tokenizer; else AutoTokenizer from ``given`` or the checkpoint; None if it has none."""
    if given is not None and not isinstance(given, str | os.PathLike):
        return given
    source = str(given or name)
    folder = Path(source) if Path(source).is_dir() else None
    if folder is not None and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    hub = {k: kw[k] for k in _HUB_KEYS if k in kw}
    if folder is not None or local is not None:
        hub["local_files_only"] = True
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust, **hub)

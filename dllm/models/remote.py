"""The remote-code path (``trust_remote_code``) for LLaDA / Dream variants, guarded against transformers-5 breakage.

Hub code written for transformers 4 fails under 5 in known ways, some loudly (turned here into one message naming
the incompatibility and the fix) and one silently: Dream's rotary ``inv_freq`` is a non-persistent buffer that
transformers 5's ``from_pretrained`` leaves uninitialised, so the logits are wrong with no error. Hence every
model loaded this way has its rotary tables checked against their formula, 1 / theta^(2i/d), and (for a local
folder) its tensors against the checkpoint's names, before use.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

FAMILIES = ("llada", "dream")
FIX = ("use the native kind (kind='llada' or kind='dream': no hub code runs) or install transformers<5 "
       "for the remote code")


class RemoteCodeError(ValueError):
    """A checkpoint's own modelling code cannot give a correct model with the installed transformers."""


def incompatibility(error: BaseException) -> str | None:
    """What a known transformers-5 failure of LLaDA / Dream remote code means, or None for any other error."""
    text = str(error)
    if isinstance(error, AttributeError) and "all_tied_weights_keys" in text:
        return ("its model class never calls post_init(), which transformers 5's from_pretrained needs "
                "(AttributeError: no 'all_tied_weights_keys'; upstream ML-GSAI/LLaDA#130)")
    if isinstance(error, TypeError) and "tie_weights()" in text and "missing_keys" in text:
        return "it overrides tie_weights() with transformers 4's signature (no missing_keys argument)"
    if isinstance(error, KeyError) and error.args == ("default",) and not _has_default_rope():
        return ("it asks for ROPE_INIT_FUNCTIONS['default'], which transformers 5 removed "
                "(KeyError: 'default'; upstream DreamLM/Dream#83)")
    if isinstance(error, TypeError) and "validate()" in text and "user_set_attributes" in text:
        return ("its DreamGenerationConfig overrides GenerationConfig.validate() with transformers 4's "
                "signature (no user_set_attributes argument)")
    if isinstance(error, AttributeError) and "GenerationConfig" in text and "'eps'" in text:
        return ("transformers 5's GenerationConfig.from_model_config compares each field with a plain "
                "GenerationConfig, which lacks Dream's (AttributeError: no 'eps')")
    return None


@contextlib.contextmanager
def guard(name, family: str, what: str = "loading"):
    """Known transformers-5 failures inside the block -> one RemoteCodeError naming the cause and the fix."""
    try:
        yield
    except (AttributeError, TypeError, KeyError) as error:
        cause = incompatibility(error)
        if cause is None:
            raise
        import transformers

        raise RemoteCodeError(f"{what} {name} with its remote code ({family}) fails under transformers "
                              f"{transformers.__version__}: {cause}; {FIX}") from error


def check_weights(model: nn.Module, folder: Path, name) -> None:
    """Refuse (RemoteCodeError) a model with tensors its local safetensors checkpoint does not hold: transformers'
    from_pretrained only warns and leaves them at their random initialisation."""
    from safetensors import safe_open

    from dllm.models.checkpoint import checkpoint_files

    try:
        files = checkpoint_files(folder)
    except FileNotFoundError:
        return  # not a safetensors checkpoint (.bin): nothing to read the names from cheaply
    stored: set[str] = set()
    for shard in files:
        with safe_open(folder / shard, framework="pt") as file:
            stored.update(file.keys())
    prefix = getattr(model, "base_model_prefix", "") or ""
    state = model.state_dict()

    def held(key: str) -> bool:  # checkpoints saved from the base model lack the prefix
        return key in stored or (prefix and key.removeprefix(f"{prefix}.") in stored)

    loaded = {state[k].data_ptr() for k in state if held(k)}
    missing = [k for k in state if not held(k) and state[k].data_ptr() not in loaded]  # tied copies count as held
    if missing:
        shown = ", ".join(map(repr, missing[:8])) + (f" ... and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise RemoteCodeError(f"{name}: its checkpoint holds no tensor for {len(missing)} of the model's "
                              f"({shown}); from_pretrained left them random, so the model is refused")


def check_rotary(model: nn.Module, config, name) -> int:
    """Refuse (RemoteCodeError) a model whose rotary tables differ from 1 / theta^(2i/d) -> tables checked.

    Checks every ``inv_freq`` buffer (Dream, Qwen2 style) and every cached ``rope_pos_sin`` / ``rope_pos_cos``
    table (LLaDA keeps them in a dict shared by its blocks), at a tolerance of the buffer's own precision.
    """
    theta = getattr(config, "rope_theta", None)
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    checked = 0
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("inv_freq"):
            dim = 2 * buffer.numel()
            expected = _inv_freq(theta, dim, buffer.device)
            if kind == "linear":
                expected = expected / float(scaling["factor"])
            elif kind != "default":  # yarn, llama3, dynamic: another formula; at least it must be a real table
                expected = None
            _compare(buffer_name, buffer, expected, name, atol=0.0)  # tail values ~1e-6: relative only
            checked += 1
    for owner, cache in _rope_caches(model):
        sin, cos = cache.get("rope_pos_sin"), cache.get("rope_pos_cos")
        if sin is None or cos is None:
            continue
        dim, length = sin.shape[-1], sin.shape[-2]
        positions = torch.arange(length, device=sin.device, dtype=torch.float32)
        freqs = torch.outer(positions, _inv_freq(theta, dim, sin.device))
        angles = torch.cat((freqs, freqs), dim=-1)
        # sin / cos of angles up to ~max_sequence_length rad: an ulp of the angle shows, so a small absolute slack
        _compare(f"{owner} rope_pos_sin", sin.reshape(length, dim), angles.sin(), name, atol=1e-5)
        _compare(f"{owner} rope_pos_cos", cos.reshape(length, dim), angles.cos(), name, atol=1e-5)
        checked += 2
    return checked


def _inv_freq(theta, dim: int, device) -> torch.Tensor:
    """1 / theta^(2i/d), i < d/2, in float32 (LLaDA's and transformers 4's default rope)."""
    if theta is None:
        raise RemoteCodeError("the config has no rope_theta, so its rotary tables cannot be checked")
    return 1.0 / (float(theta) ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def _compare(label: str, table: torch.Tensor, expected: torch.Tensor | None, name, atol: float) -> None:
    """Equal to ``expected`` within the table's precision (bf16 tables are rounded), or refuse."""
    if table.is_meta:
        raise RemoteCodeError(f"{name}: rotary table {label} was left on the meta device (never computed); {FIX}")
    values = table.detach().float()
    if expected is None:
        ok = bool(values.isfinite().all() and (values > 0).all() and (values[1:] < values[:-1]).all())
        formula = "a finite, positive, decreasing table"
    else:
        eps = torch.finfo(table.dtype).eps if table.dtype.is_floating_point else 0.0
        # a stored bf16/fp16 table is the formula rounded (<= eps/2 relative); float32 pow differs by a few ulps
        ok = torch.allclose(values, expected.to(values.device), rtol=max(eps, 1e-5), atol=atol)
        formula = "1 / theta^(2i/d)"
    if not ok:
        raise RemoteCodeError(f"{name}: rotary table {label} is not {formula} (uninitialised by from_pretrained, "
                              f"as transformers 5 leaves non-persistent buffers of remote code?): its logits would "
                              f"be silently wrong, so it is refused; {FIX}")


def _rope_caches(model: nn.Module):
    """(owner name, dict) for each distinct dict attribute of a submodule holding rotary sin/cos tables."""
    seen: set[int] = set()
    for owner, module in model.named_modules():
        for value in vars(module).values():
            if isinstance(value, dict) and "rope_pos_sin" in value and id(value) not in seen:
                seen.add(id(value))
                yield owner or type(model).__name__, value


def _has_default_rope() -> bool:
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return False
    return "default" in ROPE_INIT_FUNCTIONS

"""Hot-path kernels, each beside a torch reference with the same signature (installed as dllm.kernels).

Dispatchers (``sample_confidence``, ``verify_logits``) run the Triton kernel on CUDA tensors when Triton
is installed and the reference elsewhere; ``DLLM_KERNELS`` or ``use_kernels(mode)`` changes that
(``dllm.kernels.dispatch``). The Triton modules (``sampling_triton``, ``verify_triton``)
import ``triton`` and are loaded only when used.
"""

if not __name__.startswith("dllm."):  # imported by its bare name from the repository root: not ours to answer
    from dllm._root_folders import hand_over

    hand_over(__name__, __file__)
else:
    from .dispatch import kernel_mode, use_kernels
    from .noise import draw_seed
    from .sampling import SampleConfidence, sample_confidence, sample_confidence_reference
    from .verify import Noise, VerifyResult, verify_logits, verify_logits_reference, verify_probs

__all__ = [
    "Noise",
    "SampleConfidence",
    "VerifyResult",
    "draw_seed",
    "kernel_mode",
    "sample_confidence",
    "sample_confidence_reference",
    "use_kernels",
    "verify_logits",
    "verify_logits_reference",
    "verify_probs",
]

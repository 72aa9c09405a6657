"""The shipped default models: every sampler runs on them, and held-out accuracy stays above a floor.

Floors sit a little below what the shipped weights measure on the first 50 held-out problems at
temperature 0 (AR greedy 0.58, diffusion sequential 0.40, fef 0.40, measured with
``dllm.training.evaluate.heldout_accuracy(model, model.tokenizer, sampler, limit=50)``), so a broken
checkpoint, sampler or tokenizer fails here; fef's floor is sequential's, as greedy fef gives sequential's
tokens (checked on the shipped model).
"""

from pathlib import Path

import pytest
import torch

import dllm
from dllm.data.synthetic import format_example, heldout_set
from dllm.samplers import SAMPLERS
from dllm.training.evaluate import heldout_accuracy

WEIGHTS = Path(dllm.__file__).parent / "weights"
pytestmark = pytest.mark.skipif(not (WEIGHTS / "diffusion" / "model.safetensors").exists(),
                                reason="shipped weights not present")

DIFFUSION_OPTIONS = {
    "llada": {"steps": 8}, "dream": {"steps": 8}, "fast_dllm": {}, "eb": {}, "sequential": {},
    "fef": {"window": 4, "draft": "stale"}, "sdar": {"denoising_steps": 4}, "llada2": {"steps": 8},
}


@pytest.fixture(scope="module")
def models():
    return {name: dllm.load(WEIGHTS / name) for name in ("ar", "diffusion", "drafter", "ar_diffusion_drafter")}


def test_every_sampler_on_the_shipped_models(models):
    tokenizer = models["diffusion"].tokenizer
    prompt = torch.tensor([tokenizer(format_example(heldout_set()[0]["question"]))["input_ids"]])
    for sampler in SAMPLERS:
        if sampler == "native":  # a checkpoint's own loop: the shipped models have none (tested on DiffusionGemma)
            continue
        causal = SAMPLERS[sampler].model_kind == "causal"
        model = models["ar" if causal else "diffusion"]
        options = {} if causal else {"block_length": 8, **DIFFUSION_OPTIONS[sampler]}
        drafters = [{}]
        if sampler == "ar_spec":
            drafters = [{"drafter": d} for d in ("ngram", models["drafter"], models["diffusion"],
                                                 models["ar_diffusion_drafter"])]
        for extra in drafters:
            with torch.inference_mode():
                out = dllm.generate(model, prompt, sampler=sampler, max_new_tokens=16, temperature=0.0,
                                    **options, **extra)
            text = tokenizer.decode(out.sequences[0, prompt.shape[1]:], skip_special_tokens=True)
            assert text.startswith(" ") and out.stats.new_tokens >= 1, (sampler, extra)


@pytest.mark.parametrize("name,sampler,options,floor", [
    ("ar", "ar", {}, 0.5),
    ("diffusion", "sequential", {"block_length": 8}, 0.34),
])
def test_heldout_accuracy_floor(models, name, sampler, options, floor):
    model = models[name]
    with torch.inference_mode():
        result = heldout_accuracy(model, model.tokenizer, sampler, limit=50, **options)
    assert result["accuracy"] >= floor, result["accuracy"]


def test_greedy_fef_on_the_shipped_diffusion_model_is_sequential(models):
    """fef's floor is sequential's: greedy fef (w4, and w8 with the chain head) gives sequential's tokens on
    held-out problems, token for token, in fewer calls."""
    model = models["diffusion"]
    tokenizer = model.tokenizer
    for problem in heldout_set()[:6]:
        prompt = torch.tensor([tokenizer(format_example(problem["question"]), add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            runs = [dllm.generate(model, prompt, sampler=s, max_new_tokens=48, temperature=0.0, block_length=8, **o)
                    for s, o in (("sequential", {}), ("fef", {"window": 4}), ("fef", {"window": 8, "draft": "head"}))]
        assert all(torch.equal(runs[0].sequences, r.sequences) for r in runs[1:]), problem["question"]
        assert all(r.stats.nfe < runs[0].stats.nfe for r in runs[1:])


def test_the_distilled_drafter_keeps_ar_spec_the_targets_greedy_chain(models):
    """dllm/weights/ar_diffusion_drafter (the diffusion model fine-tuned toward the AR target) changes speed
    only: greedy ar_spec with it is ar's greedy chain token for token, with fewer target calls than tokens."""
    tokenizer = models["ar"].tokenizer
    for problem in heldout_set()[:3]:
        prompt = torch.tensor([tokenizer(format_example(problem["question"]), add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            plain = dllm.generate(models["ar"], prompt, sampler="ar", max_new_tokens=32, temperature=0.0)
            spec = dllm.generate(models["ar"], prompt, sampler="ar_spec", max_new_tokens=32, temperature=0.0,
                                 drafter=models["ar_diffusion_drafter"], num_draft_tokens=8)
        assert torch.equal(spec.sequences, plain.sequences)
        assert spec.stats.nfe < spec.stats.new_tokens


def test_every_shipped_model_declares_the_training_format_and_exports_carry_it(tmp_path):
    from transformers import AutoTokenizer

    from dllm.data.tokenizer import CHAT_TEMPLATE, export_tokenizer

    models = [folder for folder in WEIGHTS.iterdir() if (folder / "tokenizer.json").is_file()]
    assert {"ar", "diffusion", "two_stream", "sdar", "drafter", "ar_diffusion_drafter"} <= {m.name for m in models}
    for folder in models:  # one template, the project's training format, in every model folder
        assert (folder / CHAT_TEMPLATE.name).read_text() == CHAT_TEMPLATE.read_text(), folder.name
    # an exported model (a trained run's tokenizer.json alone) gets the same files, and AutoTokenizer reads them
    export_tokenizer(WEIGHTS / "diffusion" / "tokenizer.json", tmp_path / "bare")
    for name in ("tokenizer_config.json", CHAT_TEMPLATE.name):  # as a runs/ folder: tokenizer.json alone
        (tmp_path / "bare" / name).unlink()
    export_tokenizer(tmp_path / "bare" / "tokenizer.json", tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tom has 3 bags."}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == format_example("Tom has 3 bags.") and tokenizer.mask_token == "<|mask|>"

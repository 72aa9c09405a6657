"""The serving guarantees at full size, against a ``dllm serve`` process on the loopback address:

    python -m dllm.eval.study.serve_checks                      # the shipped diffusion model, fef

1. greedy: ``--prompts`` held-out prompts sent 16 at a time equal offline ``dllm.generate`` token for token;
2. seeds: ``--seeds`` seeded T=1 requests give the same tokens alone and among 15 other concurrent requests (and
   equal offline ``generate`` with that seed);
3. law: ``--samples`` seeded T=1 samples of one prompt (n=16 per request) follow the chain's law at the first answer
   token (chi-square p-value), and the same samples against the law at T=1.5 (which must be rejected).

The figures are printed; the exit status is 1 when a check fails. ``tests/test_serve.py`` runs smaller versions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dllm.eval.study.serve_checks", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="diffusion")
    p.add_argument("--sampler", default="fef")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--dtype", default="float32", help="the server's and the offline model's dtype")
    args = p.parse_args(argv)
    import httpx
    from scipy import stats

    import dllm
    from dllm.data.synthetic import format_example
    from dllm.data.synthetic import generate as problems
    from dllm.stops import model_stop_ids

    from .load import Server

    model = dllm.load(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = model.tokenizer
    prompts = [format_example(r["question"]) for r in problems(args.prompts, seed=1_000_003)]
    stop = set(model_stop_ids(model) or ())

    def offline(prompt: str, seed: int, temperature: float, tokens: int = 32) -> list[int]:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            out = dllm.generate(model, ids, sampler=args.sampler, max_new_tokens=tokens, temperature=temperature,
                                generator=torch.Generator().manual_seed(seed))
        answer = out.sequences[0, ids.shape[1]:].tolist()
        cut = [i for i, t in enumerate(answer) if t in stop]
        return answer[: cut[0]] if cut else answer

    failed = False
    flags = ["--max-queue", "400", "--dtype", args.dtype]
    with Server(args.model, flags) as server, httpx.Client(base_url=server.url, timeout=300) as http:
        def ask(prompt: str, temperature: float, seed: int, tokens: int = 32, n: int = 1) -> list[list[int]]:
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": temperature, "seed": seed, "n": n,
                    "sampler": args.sampler}
            response = http.post("/v1/completions", json=body)
            response.raise_for_status()
            return [choice["token_ids"] for choice in response.json()["dllm"]["choices"]]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda prompt: ask(prompt, 0.0, 0)[0], prompts))
        same = sum(tokens == offline(prompt, 0, 0.0) for tokens, prompt in zip(got, prompts, strict=True))
        print(f"greedy: {same}/{len(prompts)} equal offline generate token for token (sent 16 at a time)")
        failed |= same < len(prompts)

        prompt = prompts[7 % len(prompts)]
        alone = [ask(prompt, 1.0, seed)[0] for seed in range(args.seeds)]
        kept = 0
        for seed in range(args.seeds):
            others = list(range(1000 + 15 * seed, 1015 + 15 * seed))
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                crowd = list(pool.map(lambda s: ask(prompt, 1.0, s)[0], [seed, *others]))
            kept += crowd[0] == alone[seed]
        equal = sum(alone[seed] == offline(prompt, seed, 1.0) for seed in range(args.seeds))
        print(f"seeds: {kept}/{args.seeds} the same alone and among 15 concurrent requests; {equal}/{args.seeds} "
              "equal offline generate")
        failed |= kept < args.seeds or equal < args.seeds

        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            logits = model(torch.tensor([ids + [model.mask_token_id] * 8]))[0, len(ids)].double()
        requests = -(-args.samples // 16)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            firsts = [tokens[0] for batch in pool.map(lambda k: ask(prompt, 1.0, 16 * k, tokens=8, n=16),
                                                      range(requests)) for tokens in batch][: args.samples]
        counts = torch.bincount(torch.tensor(firsts), minlength=logits.shape[0]).double()
        for temperature, should_pass in ((1.0, True), (1.5, False)):
            expected = torch.softmax(logits / temperature, dim=-1) * len(firsts)
            keep = expected >= 5  # pool the rare outcomes, as chi-square needs
            observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
            predicted = torch.cat([expected[keep], expected[~keep].sum()[None]])
            pvalue = stats.chisquare(observed.numpy(), predicted.numpy() * observed.sum().item()
                                     / predicted.sum().item()).pvalue
            print(f"law: {len(firsts)} samples, first answer token against the chain at T={temperature}: "
                  f"p = {pvalue:.3g}")
            failed |= (pvalue > 1e-4) != should_pass
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

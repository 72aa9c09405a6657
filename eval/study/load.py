"""Load study of ``dllm serve``: throughput, latency and time to first token against concurrency, loopback only.

    python -m dllm.eval.study.load --output runs/load                         # ar, ar_spec, sequential, fef
    python -m dllm.eval.study.load --targets diffusion:fef --concurrency 1 16 --requests 64 --output /tmp/l
    python -m dllm.eval.study.load --targets diffusion:fef --concurrency 16 --requests 2000 \\
        --disconnect 0.05 --output runs/load_faults                         # clients leaving mid-stream

A target is ``MODEL:SAMPLER``; each model gets its own ``dllm serve`` process on 127.0.0.1 (``--serve-arg`` adds
flags), started once and stopped at the end; requests name their sampler, so one server serves every sampler of
its model. For each target and concurrency c, c clients each send streamed completions one after the other (held-
out synthetic questions, temperature ``--temperature``, seed = the request's number) until ``--requests`` were sent
or ``--seconds`` passed. Per request: the latency (send to last byte), the time to the first text, the completion
tokens (the server's ``usage``). Throughput is completion tokens over the wall time of that concurrency's run.

``--disconnect F``: that fraction of requests (every 1/F-th) is dropped after its first piece of text; every other
request must be answered exactly once, and the only errors allowed are 429s (counted). The server's resident
memory (``VmRSS``) is read before and after each run.

Written to ``--output``: ``load.json`` (every request), ``load.md`` (the table) and ``load.png`` (throughput and
p50/p99 latency against concurrency; needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_TARGETS = ("ar:ar", "ar:ar_spec", "diffusion:sequential", "diffusion:fef")


@dataclass
class Record:
    target: str
    concurrency: int
    number: int
    status: int
    latency_s: float
    first_text_s: float | None
    completion_tokens: int
    disconnected: bool
    done_markers: int  # "[DONE]" lines received: 1 for an answered stream
    run: int = 0  # which entry of --concurrency (a level may be repeated: later runs see a warm server)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dllm.eval.study.load", description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), metavar="MODEL:SAMPLER")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=64, help="requests per target and concurrency (at most)")
    p.add_argument("--seconds", type=float, default=120.0, help="time bound per target and concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--disconnect", type=float, default=0.0, help="fraction of requests dropped mid-stream")
    p.add_argument("--dtype", default="float32", help="every server's --dtype (default float32: ratios compare "
                   "alike on any CPU)")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra flag for every dllm serve (repeat)")
    p.add_argument("--output", default="runs/load")
    args = p.parse_args(argv)
    for target in args.targets:
        if target.count(":") != 1:
            p.error(f"--targets takes MODEL:SAMPLER, got {target!r}")
    if min(args.concurrency) < 1 or args.requests < 1 or args.seconds <= 0 or not 0 <= args.disconnect < 1:
        p.error("--concurrency and --requests must be >= 1, --seconds > 0, --disconnect in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import httpx  # noqa: F401 - the [test] / [serve] extras; said before any server starts

    from dllm.data.synthetic import format_example
    from dllm.data.synthetic import generate as problems

    prompts = [format_example(r["question"]) for r in problems(256, seed=1_000_003)]
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    records, memory = [], {}
    models = dict.fromkeys(target.split(":")[0] for target in args.targets)
    for model in models:
        with Server(model, ["--dtype", args.dtype, *args.serve_arg]) as server:
            for target in (t for t in args.targets if t.split(":")[0] == model):
                for run_index, concurrency in enumerate(args.concurrency):
                    before = server.rss_mib()
                    run = asyncio.run(_drive(server.url, target, concurrency, prompts, args))
                    for record in run:
                        record.run = run_index
                    memory[f"{target} c{concurrency} run {run_index + 1}"] = (before, server.rss_mib())
                    records += run
                    print(_line(target, concurrency, run), flush=True)
            server.check_answered(records)
    rows = _table(records, args)
    (output / "load.json").write_text(json.dumps({"args": vars(args), "memory_mib": memory, "rows": rows,
                                                  "requests": [asdict(r) for r in records]}, indent=1))
    (output / "load.md").write_text(_markdown(rows, memory))
    _plot(rows, output / "load.png")
    print(f"wrote {output}/load.json, load.md" + (", load.png" if (output / "load.png").exists() else ""))
    return 0


class Server:
    """``dllm serve --model MODEL`` in a process of its own on a free loopback port."""

    def __init__(self, model: str, extra: list[str]):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "dllm.cli", "serve", "--model", model, "--port", str(self.port),
                        "--host", "127.0.0.1", *extra]

    def __enter__(self):
        import httpx

        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"dllm serve did not start: {' '.join(self.command)}\n{self.process.stderr.read()}")
            time.sleep(0.2)

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def check_answered(self, records: list[Record]) -> None:
        """Every request not dropped on purpose was answered once (200 with one [DONE]) or refused with 429;
        the server's own count of requests by status agrees."""
        import httpx

        bad = [r for r in records if not r.disconnected and not (r.status == 429 or
                                                                  (r.status == 200 and r.done_markers == 1))]
        if bad:
            raise SystemExit(f"{len(bad)} requests were not answered exactly once: {bad[:3]}")
        metrics = httpx.get(self.url + "/metrics").text
        answered = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("dllm_requests_total") and 'status="200"' in line)
        expected = sum(1 for r in records if r.status == 200 and not r.disconnected and
                       r.target.split(":")[0] == self.command[self.command.index("--model") + 1])
        if answered < expected:
            raise SystemExit(f"the server counted {answered:.0f} answered requests, the clients {expected}")


async def _drive(url: str, target: str, concurrency: int, prompts: list[str], args) -> list[Record]:
    import httpx

    sampler = target.split(":")[1]
    numbers = iter(range(args.requests))
    deadline = time.monotonic() + args.seconds
    every = round(1 / args.disconnect) if args.disconnect else 0
    records: list[Record] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker():
            for number in numbers:
                if time.monotonic() > deadline:
                    return
                records.append(await _one(client, target, sampler, concurrency, number, prompts, args,
                                          drop=bool(every) and number % every == every - 1))
        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - started
    for record in records:
        record.wall_s = wall  # type: ignore[attr-defined]
    return records


async def _one(client, target, sampler, concurrency, number, prompts, args, drop: bool) -> Record:
    body = {"prompt": prompts[number % len(prompts)], "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": number, "sampler": sampler, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first, tokens, done, status = None, 0, 0, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        status = response.status_code
        if status == 200:
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        status = 500
                    text = chunk["choices"][0].get("text") if chunk.get("choices") else None
                    if text and first is None:
                        first = time.monotonic() - sent
                        if drop:
                            break
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        else:
            await response.aread()
    return Record(target, concurrency, number, status, time.monotonic() - sent, first, tokens, drop, done)


def _table(records: list[Record], args) -> list[dict]:
    rows = []
    for target in args.targets:
        base = None
        for index, concurrency in enumerate(args.concurrency):
            run = [r for r in records if r.target == target and r.run == index]
            ok = [r for r in run if r.status == 200 and not r.disconnected]
            if not run:
                continue
            wall = run[0].wall_s  # type: ignore[attr-defined]
            throughput = sum(r.completion_tokens for r in ok) / wall if wall else 0.0
            base = base or throughput
            latencies = sorted(r.latency_s for r in ok)
            firsts = sorted(r.first_text_s for r in ok if r.first_text_s is not None)
            rows.append({"target": target, "concurrency": concurrency, "run": index + 1, "requests": len(run),
                         "answered": len(ok),
                         "refused_429": sum(r.status == 429 for r in run), "errors": sum(r.status == 500 for r in run),
                         "disconnected": sum(r.disconnected for r in run), "wall_s": wall,
                         "tokens_per_s": throughput, "x_concurrency_1": throughput / base if base else None,
                         "latency_p50_s": _quantile(latencies, 0.5), "latency_p99_s": _quantile(latencies, 0.99),
                         "first_text_p50_s": _quantile(firsts, 0.5), "first_text_p99_s": _quantile(firsts, 0.99)})
    return rows


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, round(q * 100) - 1)]


def _line(target: str, concurrency: int, run: list[Record]) -> str:
    ok = [r for r in run if r.status == 200 and not r.disconnected]
    wall = run[0].wall_s if run else 0  # type: ignore[attr-defined]
    return (f"{target:24s} c={concurrency:<3d} {len(ok)}/{len(run)} answered, "
            f"{sum(r.completion_tokens for r in ok) / wall if wall else 0:.1f} tok/s")


def _markdown(rows: list[dict], memory: dict) -> str:
    def cell(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["| target | concurrency | answered / sent | 429 | tok/s | x c=1 | latency p50 / p99 s | "
             "first text p50 / p99 s | server MiB before / after |", "| --- " * 9 + "|"]
    for row in rows:
        before, after = memory.get(f"{row['target']} c{row['concurrency']} run {row['run']}", (None, None))
        lines.append(f"| {row['target']} | {row['concurrency']} | {row['answered']} / {row['requests']} | "
                     f"{row['refused_429']} | {cell(row['tokens_per_s'], 1)} | {cell(row['x_concurrency_1'], 2)} | "
                     f"{cell(row['latency_p50_s'])} / {cell(row['latency_p99_s'])} | "
                     f"{cell(row['first_text_p50_s'])} / {cell(row['first_text_p99_s'])} | "
                     f"{cell(before, 0)} / {cell(after, 0)} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from dllm.extras import missing

        print(f"no load.png: {missing('matplotlib', 'bench', 'the plot')}", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for target in dict.fromkeys(row["target"] for row in rows):
        mine = [row for row in rows if row["target"] == target]
        xs = [row["concurrency"] for row in mine]
        left.plot(xs, [row["tokens_per_s"] for row in mine], marker="o", label=target)
        right.plot(xs, [row["latency_p50_s"] for row in mine], marker="o", label=f"{target} p50")
        right.plot(xs, [row["latency_p99_s"] for row in mine], marker="x", linestyle="--", label=f"{target} p99")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens / s", title="throughput")
    right.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="seconds", title="latency")
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

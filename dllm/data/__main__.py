"""``python -m dllm.data``: print sample synthetic problems, or rewrite the held-out file."""

import argparse

from dllm.data.synthetic import HELDOUT_FILE, HELDOUT_SIZE, PRESETS, format_example, generate, write_heldout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", type=int, default=3, help="problems to print")
    parser.add_argument("--write-heldout", action="store_true",
                        help=f"rewrite {HELDOUT_FILE}: changes the test set (update its hash in tests)")
    args = parser.parse_args(argv)
    if args.write_heldout:
        print(f"wrote {HELDOUT_SIZE} problems to {write_heldout()}")
        return
    for problem in generate(args.n, args.seed, PRESETS[args.preset]):
        print(format_example(problem["question"], problem["answer"]), end="\n\n")


if __name__ == "__main__":
    main()

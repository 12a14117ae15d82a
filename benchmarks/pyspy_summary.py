"""Where a profiled process spent its busy time: a py-spy raw profile summarised (issue 69's SuperLink profile).

    py-spy record -p PID -d 60 -r 50 -f raw -o profile.txt    # while the load runs
    python -m benchmarks.pyspy_summary profile.txt[.gz] [--top 12]

py-spy samples every thread, idle ones too: a sample whose innermost frame is a wait (a thread pool's
``Condition.wait``, ``asyncio.sleep``, ``select``) is counted idle and left out; the rest are *busy*. Printed: the
busy share of all samples, the functions the busy samples were in (self), and the Flower, TLS and HTTP-server frames
they passed through (inclusive), each as a share of the busy samples.
"""

from __future__ import annotations

import argparse
import gzip
from collections import Counter
from pathlib import Path

IDLE = ("Condition.wait ", "sleep (", "select (", "poll (", "epoll")
SHOWN = ("flwr/", "ssl.py", "httptools", "h11", "sqlite", "sqlalchemy")


def summarise(lines: list[str]) -> tuple[int, int, Counter[str], Counter[str]]:
    """(all samples, busy samples, busy samples by innermost frame, by any frame on the stack)."""
    total = busy = 0
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n, frames = int(count), stack.split(";")
        total += n
        if frames[-1].startswith(IDLE):
            continue
        busy += n
        own[frames[-1]] += n
        for frame in set(frames):
            within[frame] += n
    return total, busy, own, within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    opener = gzip.open if args.profile.suffix == ".gz" else open
    with opener(args.profile, "rt") as f:
        total, busy, own, within = summarise(f.readlines())
    if not busy:
        raise SystemExit(f"{args.profile}: no busy sample")
    print(f"{total} samples, {busy} busy ({100 * busy / total:.1f} %)")
    print("busy, innermost frame:")
    for frame, n in own.most_common(args.top):
        print(f"  {100 * n / busy:5.1f} %  {frame}")
    print("busy, on the stack (Flower, TLS, HTTP, SQL frames):")
    for frame, n in [(f, n) for f, n in within.most_common() if any(k in f for k in SHOWN)][:2 * args.top]:
        print(f"  {100 * n / busy:5.1f} %  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

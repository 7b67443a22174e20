"""Where each server process's time goes, from gpu_tp.sh's profile phase: py-spy's collapsed stacks
(`--format raw`, one line a stack: frames separated by ';', then the sample count) of every process.

    python benchmark/online/profile_summary.py out/profile.tgz      # or the profile_<pid>.txt files

For each process and thread (py-spy --threads puts the thread first in each stack): its samples, the
share spent waiting (a leaf that polls, selects, or waits on a lock, a condition or a CUDA event), the
share inside an event loop's own C code (uvloop: waiting for sockets or running libuv, which Python
stacks cannot tell apart), the frames of minisgl with the largest inclusive share, and the busiest
leaves. py-spy records with --idle, so waiting counts as samples and the shares are of wall time.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import tarfile
from collections import Counter
from dataclasses import dataclass, field

LOOP = re.compile(r"^(Runner\.run|.*run_until_complete|.*run_forever)$")
WAITING = re.compile(r"\b(select|poll|epoll_wait|wait|acquire|recv|read|sleep|synchronize|_poll)\b", re.I)


@dataclass
class Profile:
    name: str
    samples: int = 0
    waiting: int = 0
    in_loop: int = 0
    inclusive: Counter = field(default_factory=Counter)
    leaves: Counter = field(default_factory=Counter)


def _function(frame: str) -> str:
    return frame.split(" (")[0].strip()


def read_collapsed(name: str, lines: list[str]) -> list[Profile]:
    """One Profile a thread where the stacks start with one (py-spy --threads), else one for the process."""
    threads: dict[str, Profile] = {}
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else ""
        prof = threads.setdefault(thread, Profile(f"{name} {thread}".strip()))
        prof.samples += n
        leaf = frames[-1]
        prof.leaves[leaf] += n
        if LOOP.match(_function(leaf)):
            prof.in_loop += n
        elif WAITING.search(_function(leaf)):
            prof.waiting += n
        for frame in set(frames):
            if "minisgl/" in frame:
                prof.inclusive[frame] += n
    return list(threads.values())


def load(paths: list[str]) -> list[Profile]:
    """Profiles from profile_<pid>.txt files or the archive holding them (roles from profile_pids.txt)."""
    files: dict[str, list[str]] = {}
    for path in paths:
        if path.endswith((".tgz", ".tar.gz")):
            with tarfile.open(path) as tar:
                for member in tar.getmembers():
                    data = tar.extractfile(member)
                    if data is not None:
                        files[os.path.basename(member.name)] = io.TextIOWrapper(data).read().splitlines()
        else:
            with open(path) as f:
                files[os.path.basename(path)] = f.read().splitlines()
    roles = {}
    for line in files.pop("profile_pids.txt", []):
        pid, _, cmd = line.partition(" ")
        roles[pid] = cmd[:80]
    out = []
    for name, lines in sorted(files.items()):
        m = re.fullmatch(r"profile_(\d+)\.txt", name)
        if m:
            out += read_collapsed(f"pid {m.group(1)} {roles.get(m.group(1), '')}".strip(), lines)
    return out


def report(prof: Profile, top: int = 12) -> str:
    if not prof.samples:
        return f"== {prof.name}: no samples"
    share = lambda n: f"{100 * n / prof.samples:5.1f}%"  # noqa: E731
    lines = [
        f"== {prof.name}: {prof.samples} samples, waiting {share(prof.waiting)}, "
        f"in the event loop's C code {share(prof.in_loop)}"
    ]
    lines += [f"  {share(n)} incl  {f[:110]}" for f, n in prof.inclusive.most_common(top)]
    lines += [f"  {share(n)} leaf  {f[:110]}" for f, n in prof.leaves.most_common(top // 2)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    for prof in load(args.paths):
        print(report(prof, args.top))


if __name__ == "__main__":
    main()

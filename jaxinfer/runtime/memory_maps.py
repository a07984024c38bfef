"""Room for more executables under the kernel's cap on a process's memory mappings.

XLA:CPU maps the code, constants and data of each kernel of an executable as separate pages: a
SmolLM2 step (30 unrolled layers) takes ~750 mappings, compiled or loaded from a cache alike.
Linux caps a process's mappings (`vm.max_map_count`, 65,530 by default); past the cap LLVM
cannot allocate and the process dies in a segfault. An engine with many shape buckets can reach
it: n-gram speculation with 32 sequences warms up 55 executables (~41,000 mappings), twice that
before every step carried the structured-output bitmask (docs/performance.md).

So the runner measures what its executables take and checks, before it prepares more, that they
fit; if not it raises an error that names the limit and the ways out, instead of crashing
halfway. Elsewhere than Linux (no /proc) nothing is checked.
"""

from __future__ import annotations

MAX_MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
MAPS_FILE = "/proc/self/maps"
HEADROOM = 2_000  # mappings left for everything else the process does (arrays, threads, files)


def limit() -> int | None:
    """vm.max_map_count, or None where it cannot be read."""
    try:
        with open(MAX_MAP_COUNT_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def in_use() -> int | None:
    """This process's memory mappings now, or None where they cannot be counted."""
    try:
        with open(MAPS_FILE, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def room_error(num_new: int, per_executable: float, used: int | None,
               cap: int | None) -> str | None:
    """Why `num_new` more executables of `per_executable` mappings each do not fit under `cap`
    with `used` taken, or None when they fit (or nothing can be known)."""
    if used is None or cap is None or num_new <= 0 or per_executable <= 0:
        return None
    need = int(num_new * per_executable)
    if used + need + HEADROOM <= cap:
        return None
    return (f"{num_new} more step executable(s) need about {need:,} memory mappings "
            f"(~{per_executable:.0f} each, measured), but {used:,} of this process's limit of "
            f"{cap:,} (vm.max_map_count) are in use: past it XLA cannot load code and the "
            f"process crashes. Raise the limit (sudo sysctl -w vm.max_map_count=262144) or "
            f"compile fewer step shapes (a smaller max_num_seqs or max_num_batched_tokens, "
            f"no speculative decoding)")


def check_room(num_new: int, per_executable: float) -> None:
    """Raises RuntimeError when `num_new` executables of `per_executable` mappings would pass
    the process's limit (see room_error)."""
    error = room_error(num_new, per_executable, in_use(), limit())
    if error is not None:
        raise RuntimeError(error)

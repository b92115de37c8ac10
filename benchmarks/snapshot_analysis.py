"""Who holds the GPU memory alive at one moment: an analysis of a CUDA caching allocator snapshot
(``torch.cuda.memory._snapshot()`` taken while ``torch.cuda.memory._record_memory_history`` records
Python stacks), in plain Python so it runs on any snapshot dict, also a synthetic one on the CPU.

Each allocated block is grouped by (site, owner): the innermost Python frame that allocated it, and
the innermost one outside torch and Inductor's generated code (the code on whose behalf torch
allocated). Blocks that no tensor reachable from Python points into (``python_tensor_storages``:
what ``gc`` finds) are counted apart: they are held from C++ (autograd, compiled graphs, cuBLAS).
Used by benchmarks/hf_clients.py ``--snapshot``.
"""

import bisect
import collections
import gc
import pathlib
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake

REPO = pathlib.Path(__file__).resolve().parents[1]
NO_FRAMES = "<no Python frames>"
GENERATED = "<inductor generated>"


def short_path(filename):
    """A frame's file, short: from site-packages on, or relative to this repository; Inductor's
    generated code as ``<inductor generated>/NAME``."""
    if "torchinductor" in filename:
        return f"{GENERATED}/{pathlib.PurePath(filename).name}"
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    try:
        return str(pathlib.Path(filename).resolve().relative_to(REPO))
    except (ValueError, OSError):
        return filename


def category(path):
    """Whose code a short path is: flash_inductor (package and passes), Inductor's generated code,
    torch, transformers, a peer (torchao, flashoptim), or user (benchmarks, tests, anything else)."""
    if path.startswith(("flash_inductor/", "passes/")):
        return "flash_inductor"
    if path.startswith((GENERATED, NO_FRAMES)):
        return path.split("/", 1)[0]
    top = path.split("/", 1)[0]
    return top if top in ("torch", "transformers", "torchao", "flashoptim") else "user"


def _frame(f):
    path = short_path(f["filename"])
    return path, f"{path}:{f['line']} {f['name']}"


def block_origin(frames):
    """(site, owner) of an allocation from its Python frames (innermost first): ``site`` the
    innermost frame, ``owner`` the innermost frame outside torch and generated code (the code on
    whose behalf torch allocated); ``<no Python frames>`` for allocations from C++ threads (autograd's)."""
    shown = [_frame(f) for f in frames]
    if not shown:
        return NO_FRAMES, NO_FRAMES
    owner = next((text for path, text in shown if category(path) not in ("torch", GENERATED)), shown[-1][1])
    return shown[0][1], owner


def live_blocks(snapshot, exclude=()):
    """The allocated blocks of a ``torch.cuda.memory._snapshot()`` dict: (address, size, frames),
    except those whose (address, size) is in ``exclude`` (alive before the recording started)."""
    exclude = set(exclude)
    return [(b["address"], b["size"], b.get("frames", [])) for seg in snapshot["segments"] for b in seg["blocks"]
            if b["state"] == "active_allocated" and (b["address"], b["size"]) not in exclude]


def peak_blocks(snapshot, start=0, device=0):
    """(bytes, blocks) at the peak of what the recorded trace allocated, over its events from ``start``
    on: the trace replayed from the recording's start (``alloc`` adds a block, ``free_completed``
    removes it; blocks alive before the recording are not counted), the blocks alive at the first
    event that reaches the peak as (address, size, frames). The trace must hold the whole recording
    (``_record_memory_history``'s ``max_entries`` not reached)."""
    trace = snapshot["device_traces"][device]
    total = peak = 0
    peak_at = -1
    for i, event in enumerate(trace):
        total += _size_change(event)
        if i >= start and total > peak:
            peak, peak_at = total, i
    alive = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = (event["addr"], event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    return peak, list(alive.values())


def _size_change(event):
    return {"alloc": event["size"], "free_completed": -event["size"]}.get(event["action"], 0)


def analyse_snapshot(snapshot, report=None, python_storages=None, exclude=(), top=20):
    """What is alive in a memory snapshot, by the code that allocated it: ``analyse_blocks`` of its
    allocated blocks but those ``exclude`` names ((address, size) pairs)."""
    return analyse_blocks(live_blocks(snapshot, exclude), report, python_storages, top)


def analyse_blocks(blocks, report=None, python_storages=None, top=20):
    """What ``blocks`` ((address, size, frames)) hold, by the code that allocated them.

    ``report``: bytes by component (``memory_report``), compared with the total; ``python_storages``:
    {data pointer: bytes} of the storages of tensors Python can reach (``python_tensor_storages``),
    to tell the blocks no Python tensor points into. Returns a dict of totals (``python_bytes``: of
    the reachable storages inside the blocks), the ``top`` groups by (site, owner) and the ``top``
    owners, largest first (a compiled graph allocates each buffer from a line of its own, so its
    blocks group by the model code they were allocated for only)."""
    pointers = sorted(python_storages or {})
    groups = collections.defaultdict(lambda: {"bytes": 0, "blocks": 0, "unreachable_bytes": 0})
    owners = collections.defaultdict(lambda: {"bytes": 0, "blocks": 0})
    by_category = collections.Counter()
    by_owner_category = collections.Counter()
    unreachable = python_bytes = 0
    for address, size, frames in blocks:
        site, owner = block_origin(frames)
        inside = pointers[bisect.bisect_left(pointers, address):bisect.bisect_left(pointers, address + size)]
        python_bytes += sum(python_storages[p] for p in inside)
        reachable = bool(inside)  # a storage of a tensor Python reaches starts inside the block
        g = groups[site, owner]
        g["bytes"] += size
        g["blocks"] += 1
        owners[owner]["bytes"] += size
        owners[owner]["blocks"] += 1
        if python_storages is not None and not reachable:
            g["unreachable_bytes"] += size
            unreachable += size
        by_category[category(site.split(":")[0])] += size
        by_owner_category[category(owner.split(":")[0])] += size
    total = sum(size for _, size, _ in blocks)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
    out = {
        "live_bytes": total, "live_blocks": len(blocks),
        "by_site_category": dict(by_category.most_common()), "by_owner_category": dict(by_owner_category.most_common()),
        "groups": [{"site": s, "owner": o, **g} for (s, o), g in ranked[:top]],
        "groups_left_out": max(0, len(ranked) - top),
        "owners": [{"owner": o, **g} for o, g in sorted(owners.items(), key=lambda kv: -kv[1]["bytes"])[:top]],
    }
    if python_storages is not None:
        out.update(python_bytes=python_bytes, unreachable_bytes=unreachable)
    if report is not None:
        without_grads = sum(v for k, v in report.items() if k != "grads")
        out.update(report_bytes=dict(report), report_without_grads_bytes=without_grads, gap_bytes=total - without_grads)
    return out


def python_tensor_storages(device_type):
    """{data pointer: bytes} of the storages of every tensor on ``device_type`` that Python's garbage
    collector can reach (plain tensors; a wrapper subclass's inner tensors are found themselves)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some objects (deprecated proxies) warns
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type != device_type or is_fake(obj):
                    continue
                storage = obj.untyped_storage()
                pointer, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError, ReferenceError, TypeError):
                continue  # no storage: a wrapper subclass, a tensor whose storage is invalid (functionalized)
            if size and pointer:
                out[pointer] = max(out.get(pointer, 0), size)
    return out


def format_analysis(a, title, moment="between steps"):
    mib = 2**20
    lines = [title, f"live {moment}: {a['live_bytes'] / mib:.1f} MiB in {a['live_blocks']} blocks"]
    if "report_bytes" in a:
        parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in a["report_bytes"].items())
        lines.append(f"memory_report (MiB): {parts}; without grads {a['report_without_grads_bytes'] / mib:.1f}; "
                     f"live - report = {a['gap_bytes'] / mib:.1f} MiB")
    if "python_bytes" in a:
        lines.append(f"reachable from Python (gc): {a['python_bytes'] / mib:.1f} MiB; "
                     f"live blocks no Python tensor points into: {a['unreachable_bytes'] / mib:.1f} MiB")
    lines.append("by site's code: " + ", ".join(f"{k} {v / mib:.1f}" for k, v in a["by_site_category"].items()))
    lines.append("by owner's code: " + ", ".join(f"{k} {v / mib:.1f}" for k, v in a["by_owner_category"].items()))
    lines.append(f"{'MiB':>9} {'blocks':>6} {'unreach.':>9}  site  <-  owner")
    for g in a["groups"]:
        owner = "" if g["owner"] == g["site"] else f"  <-  {g['owner']}"
        lines.append(f"{g['bytes'] / mib:9.1f} {g['blocks']:6d} {g['unreachable_bytes'] / mib:9.1f}  {g['site']}{owner}")
    if a["groups_left_out"]:
        lines.append(f"... {a['groups_left_out']} smaller groups left out")
    lines.append(f"{'MiB':>9} {'blocks':>6}  owner (the blocks of every site allocated on its behalf)")
    lines += [f"{o['bytes'] / mib:9.1f} {o['blocks']:6d}  {o['owner']}" for o in a["owners"]]
    return "\n".join(lines)

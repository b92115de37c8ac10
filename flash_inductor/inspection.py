"""What the backend did, as readable Python: every graph before and after every pass.

``flash_inductor.inspect(fn, *args)`` runs ``fn`` once through the backend and returns a
``Report``. ``FLASHOPTIM_DUMP=folder`` (or the option ``dump``) writes the same files for every
graph any compiled program produces.

The report also names every graph break Dynamo took while ``fn`` ran (where, and Dynamo's reason):
each one splits the code around it into separate graphs, which the passes and Inductor see one at
a time. They come from Dynamo's ``graph_breaks`` log (``TORCH_LOGS=graph_breaks``), collected
while inspecting.
"""

import contextlib
import dataclasses
import inspect
import logging
import os
import re
import time

import torch
from torch._inductor.graph import GraphLowering

from flash_inductor import triton_adam

_active = []  # Report objects collecting right now (inspect() calls)


@dataclasses.dataclass
class Stage:
    level: str  # "torch" or "aten"
    subgraph: str  # "dynamo", "forward", "backward" or "inference"
    name: str  # "captured", "post_grad" or a pass name
    code: str
    rewritten: list = dataclasses.field(default_factory=list)

    @property
    def filename(self):
        return f"{self.subgraph}.{self.name}.py"


@dataclasses.dataclass
class GraphRecord:
    """One Dynamo graph: its stages and the code Inductor generated for it."""

    name: str
    kind: str  # "optimizer step" or "model"
    roles: dict
    stages: list = dataclasses.field(default_factory=list)
    kernels: dict = dataclasses.field(default_factory=dict)  # subgraph -> generated code
    decisions: list = dataclasses.field(default_factory=list)  # (pass, subject, decision)
    # wall seconds of the torch-level passes ("passes") and of Inductor's compile of each subgraph
    compile_seconds: dict = dataclasses.field(default_factory=dict)
    subgraph: str = "dynamo"
    dump_dir: str | None = None

    def stage(self, level, name, code, rewritten=()):
        stage = Stage(level, self.subgraph, name, code, list(rewritten))
        self.stages.append(stage)
        self._dump(stage.filename, code)

    def decision(self, pass_name, subject, decision):
        """What a pass decided about one candidate, e.g. a linear layer kept in bf16 and why."""
        self.decisions.append((pass_name, subject, decision))

    def pass_skipped(self, pass_name, first_decision, reason):
        """``pass_name`` failed on this graph, which compiles without it: its decisions from
        ``first_decision`` on did not happen."""
        del self.decisions[first_decision:]
        self.decisions.append((pass_name, f"{self.subgraph} graph", f"pass skipped, no rewrite: {reason}"))

    def compile_seconds_text(self):
        """``compile_seconds`` as one line: ``passes 0.04, forward 2.89, backward 0.94``."""
        return ", ".join(f"{part} {seconds:.2f}" for part, seconds in self.compile_seconds.items())

    def add_kernel_code(self, code):
        self.kernels[self.subgraph] = self.kernels.get(self.subgraph, "") + code
        self._dump(f"{self.subgraph}.inductor_output.py", self.kernels[self.subgraph])

    @property
    def kernel_backends(self):
        code = "\n".join(self.kernels.values())
        found = []
        if "@triton.jit" in code:
            found.append("triton")
        if "cpp_fused" in code or "extern \"C\"" in code:
            found.append("cpp")
        return found

    def _dump(self, filename, code):
        if self.dump_dir:
            folder = os.path.join(self.dump_dir, self.name)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, filename), "w") as f:
                f.write(code)


@dataclasses.dataclass
class GraphBreak:
    """A graph break: the user code where Dynamo stopped tracing, and why."""

    location: str  # "file:line" of the innermost user frame
    reason: str  # Dynamo's reason: what it could not trace, with its explanation and hint
    traceback: str = ""  # the user code traceback (Dynamo gives it once per location)

    @property
    def headline(self):
        """The reason in one line: its first paragraph that says more than "Encountered graph
        break when attempting to trace ...", which most reasons start with."""
        paragraphs = [p.strip() for p in self.reason.split("\n\n") if p.strip()] or ["?"]
        specific = [p for p in paragraphs if not p.startswith("Encountered graph break")]
        return (specific or paragraphs)[0].splitlines()[0]

    @classmethod
    def from_log(cls, message):
        """From one message of Dynamo's ``graph_breaks`` log (a skipped frame's has no "user code at"
        line: its innermost traceback frame is the location)."""
        located = re.search(r"in user code at (.+):(\d+)\n", message)
        frames = re.findall(r'File "(.+?)", line (\d+)', message)
        where = located.groups() if located else frames[-1] if frames else ("?", "?")
        reason = re.search(r"Graph Break Reason: (.*?)(?:\nUser code traceback:|\Z)", message, re.DOTALL)
        traceback = message.partition("User code traceback:\n")[2]
        return cls(f"{where[0]}:{where[1]}", (reason.group(1) if reason else message).strip(), traceback.rstrip())


class _GraphBreakCollector(logging.Handler):
    def __init__(self, report):
        super().__init__(logging.DEBUG)
        self.report = report

    def emit(self, record):
        found = GraphBreak.from_log(record.getMessage())
        # Dynamo logs a break again at each restart of the frame's tracing: one entry per location.
        if all(b.location != found.location for b in self.report.graph_breaks):
            self.report.graph_breaks.append(found)


def _graph_break_loggers():
    # Dynamo's modules each log graph breaks to their own artifact logger ("graph_breaks").
    return [log for log in list(logging.Logger.manager.loggerDict.values())
            if isinstance(log, logging.Logger) and getattr(log, "artifact_name", None) == "graph_breaks"]


@contextlib.contextmanager
def _collecting_graph_breaks(report):
    handler = _GraphBreakCollector(report)
    saved = [(log, log.level, log.propagate) for log in _graph_break_loggers()]
    for log, _, _ in saved:
        if not log.isEnabledFor(logging.DEBUG):
            log.setLevel(logging.DEBUG)
            log.propagate = False  # collected here, not printed (unless TORCH_LOGS asked for them)
        log.addHandler(handler)
    try:
        yield
    finally:
        for log, level, propagate in saved:
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate


class Report:
    """Every graph captured while the inspected function ran, and the graph breaks between them."""

    def __init__(self):
        self.graphs: list[GraphRecord] = []
        self.graph_breaks: list[GraphBreak] = []
        self.memory = []  # flash_inductor.memory.MemoryReport of each prepared optimizer

    def summary_rows(self):
        rows = []
        for g in self.graphs:
            for s in g.stages:
                if s.name not in ("captured", "post_grad"):
                    rows.append((g.name, g.kind, f"{s.level}:{s.subgraph}", s.name, len(s.rewritten)))
        return rows

    def summary(self):
        header = ("graph", "kind", "level", "pass", "rewritten")
        rows = [header] + [tuple(str(c) for c in r) for r in self.summary_rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for g in self.graphs:
            lines.append(f"{g.name}: kernels generated: {', '.join(g.kernel_backends) or 'none'}")
            if g.compile_seconds:
                lines.append(f"{g.name}: compile seconds: {g.compile_seconds_text()}")
            lines += [f"{g.name}: {p}: {subject}: {decision}" for p, subject, decision in g.decisions]
        lines += [f"graph break at {b.location}: {b.headline}" for b in self.graph_breaks]
        for memory in self.memory:
            lines += ["", str(memory)]
        return "\n".join(lines)

    def __str__(self):
        parts = [self.summary()]
        for b in self.graph_breaks:
            parts += ["", f"==== graph break at {b.location}", b.reason]
            if b.traceback:
                parts += ["User code traceback:", b.traceback]
        for g in self.graphs:
            for s in g.stages:
                title = f"==== {g.name} ({g.kind}) {s.level}:{s.subgraph} after {s.name}"
                if s.rewritten:
                    title += f" (rewrote {', '.join(s.rewritten)})"
                parts += ["", title, s.code.rstrip()]
        return "\n".join(parts)

    def graph(self, kind):
        """The first graph of ``kind`` ("optimizer step" or "model")."""
        for g in self.graphs:
            if g.kind == kind:
                return g
        raise KeyError(f"no {kind!r} graph was captured; kinds: {sorted({g.kind for g in self.graphs})}")

    def save(self, folder):
        """Write one file per graph and stage, the generated code, and ``summary.txt``."""
        os.makedirs(folder, exist_ok=True)
        for g in self.graphs:
            g.dump_dir = folder
            for s in g.stages:
                g._dump(s.filename, s.code)
            for subgraph, code in g.kernels.items():
                g._dump(f"{subgraph}.inductor_output.py", code)
        with open(os.path.join(folder, "summary.txt"), "w") as f:
            f.write(self.summary() + "\n")
        return folder


def new_graph_record(name, kind, roles, options):
    """A record for a graph being compiled, or None when nobody is inspecting or dumping."""
    if not _active and not options.dump:
        return None
    record = GraphRecord(name, kind, {k: r.describe() for k, r in roles.items()})
    record.dump_dir = options.dump
    for report in _active:
        report.graphs.append(record)
    return record


@contextlib.contextmanager
def timing(record, part):
    """Add the wall seconds the block takes to ``record.compile_seconds[part]`` (nothing without a record)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if record is not None:
            record.compile_seconds[part] = record.compile_seconds.get(part, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def compiling_subgraph(record, subgraph):
    """Attribute aten-level stages, generated code and compile time to ``subgraph`` while Inductor
    compiles it."""
    if record is None:
        yield
        return
    previous = record.subgraph
    record.subgraph = subgraph
    original = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(record.add_kernel_code)
    try:
        with timing(record, subgraph):
            yield
    finally:
        GraphLowering.save_output_code = original
        record.subgraph = previous


HAND_WRITTEN_STEP = "flash_inductor.triton_adam"


def note_step_kernels(optimizer_record, why_not):
    """For reports collecting now: which flat buckets the hand-written Triton step ran ({bucket: None})
    and why the others were compiled instead ({bucket: reason}), and, of each bucket it ran, whether
    it read every gradient where the backward left it or which it copied into the flat buffer, and
    why; one record per report."""
    for report in _active:
        if any(g.name == HAND_WRITTEN_STEP for g in report.graphs) or all(why_not.values()):
            continue
        record = GraphRecord(HAND_WRITTEN_STEP, "optimizer step", {})
        record.kernels["optimizer step"] = inspect.getsource(triton_adam)
        for bucket, reason in why_not.items():
            record.decision("step_kernel", bucket.name, "hand-written Triton kernel" if reason is None else
                            f"compiled stock update ({reason})")
            if reason is None:
                copied = [f"{optimizer_record.param_names.get(bucket.params[i], i)} ({why})"
                          for i, why in bucket.copied_gradients.items()]
                record.decision("gradients", bucket.name, "read where the backward left them" if not copied else
                                f"{len(copied)} copied into the flat buffer: {', '.join(copied)}")
        report.graphs.append(record)


def uncached_config():
    """Inductor/AOT cache settings under which every pass really runs (a cache hit skips them)."""
    return {"fx_graph_cache": False, "fx_graph_remote_cache": False}


@contextlib.contextmanager
def collecting(report):
    _active.append(report)
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False), _collecting_graph_breaks(report):
            yield report
    finally:
        _active.remove(report)

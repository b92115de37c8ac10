"""Options of the ``flashoptim`` backend: ``torch.compile(backend="flashoptim", options={...})``."""

import dataclasses
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Options:
    """What the backend does. Every field can be given by name in ``options={...}``.

    disable: names of passes to switch off (see ``flash_inductor.passes.ALL_PASSES``).
    inductor: extra Inductor config patches, e.g. ``{"combo_kernels": True}``.
    dump: folder to write every graph before and after each pass to (also ``FLASHOPTIM_DUMP``).
    compiler: "inductor", or "eager" to run the rewritten graphs without Inductor (debugging:
        same rewrites, no kernels).
    """

    disable: tuple[str, ...] = ()
    inductor: tuple[tuple[str, Any], ...] = ()
    dump: str | None = None
    compiler: str = "inductor"

    @classmethod
    def from_dict(cls, options):
        options = dict(options or {})
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"flashoptim: unknown option(s) {unknown}; valid options are {sorted(valid)}"
            )
        disable = options.get("disable", ())
        if isinstance(disable, str):
            disable = (disable,)
        _check_pass_names(disable)
        inductor = options.get("inductor", ())
        if isinstance(inductor, dict):
            inductor = tuple(sorted(inductor.items()))
        dump = options.get("dump") or os.environ.get("FLASHOPTIM_DUMP") or None
        compiler = options.get("compiler", "inductor")
        if compiler not in ("inductor", "eager"):
            raise ValueError(f"flashoptim: option 'compiler' must be 'inductor' or 'eager', got {compiler!r}")
        return cls(disable=tuple(disable), inductor=tuple(inductor), dump=dump, compiler=compiler)

    def enabled(self, pass_name):
        return pass_name not in self.disable


def _check_pass_names(names):
    from flash_inductor.passes import ALL_PASSES

    known = [p.name for p in ALL_PASSES]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"flashoptim: option 'disable' names unknown pass(es) {unknown}; passes are {known}")

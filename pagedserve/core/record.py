"""`@record`: a frozen, slotted dataclass whose __init__ is 3x cheaper, for the records made per sequence per
step (ScheduledSeq, SamplingRow, TableDelta, SeqUpdate, SeqTimes).

A frozen dataclass's generated __init__ sets each field with `object.__setattr__(self, name, value)` (frozen
classes refuse plain assignment); measured here, 2.1-3.0 µs for a 12-field record against 0.36 µs unfrozen,
and a step makes about five such records per sequence (issue 53: host work per sequence). This __init__ calls
each slot's own setter instead (1.0 µs), and the class stays what `dataclass(slots=True, frozen=True)` makes:
assignment raises FrozenInstanceError, eq / hash / repr / `dataclasses.replace` are dataclasses' own."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields


def record(cls: type) -> type:
    cls = dataclass(slots=True, frozen=True)(cls)
    env: dict[str, object] = {"_MISSING": MISSING}
    params, body = [], []
    for f in fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"@record: field {cls.__name__}.{f.name} must be a plain positional init field")
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__          # the slot's member descriptor
        value = f.name
        if f.default is not MISSING:
            env[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            value = f"_factory_{f.name}() if {f.name} is _MISSING else {f.name}"
        else:
            params.append(f.name)
        body.append(f"    _set_{f.name}(self, {value})\n")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()\n")
    ns: dict[str, object] = {}
    exec(f"def __init__(self, {', '.join(params)}):\n{''.join(body) or '    pass'}", env, ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init
    return cls

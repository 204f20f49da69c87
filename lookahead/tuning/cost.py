"""`CostModel`: what one forward pass costs on the machine it runs on, one `Curve` per kind of step ("greedy" and
"sampling": a sampled step also draws at every verified row), measured there and kept current (`curve.py`).

Kept on disk under the user's cache folder, keyed by what the figures depend on (device, model shape, dtype, backend,
threads, versions: `save`/`load`), as the next process's starting point. A file is read only if it is a regular file
of at most `MAX_FILE_BYTES`; one that does not parse (however it fails) or whose figures are not what `save` writes
(int knots up to `curve.MAX_KNOT`, finite positive costs) is not trusted: `load` returns None and the caller measures
again.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .curve import Curve

KINDS = ("greedy", "sampling")
FORMAT = 1  # the cache file's layout; a file of another is measured again
MAX_FILE_BYTES = 1 << 16  # a cost file is ~2 KB; a larger one is not ours (and /dev/zero never ends)


@dataclass
class CostModel:
    """The measured cost of a step on one machine, per kind of step ("greedy", "sampling"), and what it was measured
    on (`key`). Read it as `model.cost_model`; set one (for tests, or to fix the costs) the same way."""

    curves: dict[str, Curve] = field(default_factory=dict)
    key: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse a cost model that is not one (TypeError, ValueError naming what is wrong): curves must map kinds of
        `KINDS` to `Curve`s (each checked again: their lists may have been changed since), key must be a dict."""
        if not isinstance(self.curves, dict):
            raise TypeError(f"CostModel.curves must be a dict {{kind: Curve}}, got {type(self.curves).__name__}")
        for kind, curve in self.curves.items():
            if kind not in KINDS:
                raise ValueError(f"CostModel.curves: kinds are {KINDS}, got {kind!r}")
            if not isinstance(curve, Curve):
                raise TypeError(f"CostModel.curves[{kind!r}] must be a Curve, got {type(curve).__name__}")
            curve.check()
        if not isinstance(self.key, dict):
            raise TypeError(f"CostModel.key must be a dict, got {type(self.key).__name__}")

    def covers(self, kind: str, tokens: int) -> bool:
        """Whether the `kind` curve was measured up to steps of `tokens` tokens."""
        curve = self.curves.get(kind)
        return curve is not None and curve.knots[-1] >= tokens

    def predict(self, tokens: int, length: int, kind: str = "greedy") -> float:
        """Seconds of a step of `tokens` tokens (all rows) over `length` cached positions."""
        return self._curve(kind).predict(tokens, length)

    def predict_many(self, tokens: Sequence[int], length: int, kind: str = "greedy") -> list[float]:
        """`predict` of each of `tokens`, bit for bit (`Curve.predict_many`; a subclass's own `predict` is asked for
        each, as it was before this existed)."""
        if type(self).predict is not CostModel.predict:
            return [self.predict(t, length, kind) for t in tokens]
        return self._curve(kind).predict_many(tokens, length)

    def observe(self, tokens: int, length: int, seconds: float, kind: str = "greedy") -> None:
        """Fold a step's measured time into the curve (see `Curve.observe`)."""
        self._curve(kind).observe(tokens, length, seconds)

    def stale_knot(self, tokens: int, kind: str = "greedy") -> int | None:
        """The knot of the `kind` curve a step of `tokens` tokens would run, where no step ran it lately (else
        None; see `Curve.stale_knot`)."""
        return self._curve(kind).stale_knot(tokens)

    def stale_knots(self, tokens: Sequence[int], kind: str = "greedy") -> list[int | None]:
        """`stale_knot` of each of `tokens` (`Curve.stale_knots`; a subclass's own `stale_knot` is asked for each)."""
        if type(self).stale_knot is not CostModel.stale_knot:
            return [self.stale_knot(t, kind) for t in tokens]
        return self._curve(kind).stale_knots(tokens)

    def floor(self, tokens: int, length: int, kind: str = "greedy") -> float:
        """The least a step of `tokens` tokens may cost by the knots steps ran lately (see `Curve.floor`)."""
        return self._curve(kind).floor(tokens, length)

    def plain_rate(self, length: int, kind: str = "greedy") -> float:
        """Tokens per second plain decoding would give here at cache length `length` (one token a step)."""
        return 1.0 / self.predict(1, length, kind)

    def extend(self, kind: str, measured: Curve) -> None:
        """Add a newly measured curve of `kind`: the knots this model already has stay as its steps left them, and
        `measured`'s beyond them are added."""
        old = self.curves.get(kind)
        if old is None:
            self.curves[kind] = measured
            return
        knots, base, per_position = list(old.knots), list(old.base), list(old.per_position)
        for k, b, p in zip(measured.knots, measured.base, measured.per_position, strict=True):
            if k > knots[-1]:
                knots.append(k)
                base.append(b)
                per_position.append(p)
        self.curves[kind] = Curve(knots, base, per_position)

    def _curve(self, kind: str) -> Curve:
        curve = self.curves.get(kind)
        if curve is None:
            raise KeyError(f"this cost model has no {kind!r} curve (it has {sorted(self.curves)}); measure one first")
        return curve

    def to_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key, "curves": {k: c.to_dict() for k, c in self.curves.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> CostModel:
        """The model a `to_dict` wrote; ValueError on anything else (JSON's true is not the format 1, "2" or 1.7 not a
        knot, 10**40 not a step's size)."""
        if not isinstance(data, Mapping) or type(data.get("format")) is not int or data["format"] != FORMAT:
            raise ValueError(f"not a cost model of format {FORMAT}")
        curves, key = data.get("curves"), data.get("key", {})
        if not isinstance(curves, Mapping) or not set(curves) <= set(KINDS):
            raise ValueError(f"a cost model's curves must be a mapping of {KINDS}")
        if not isinstance(key, Mapping):
            raise ValueError(f"a cost model's key must be a mapping, got {type(key).__name__}")
        try:
            built = {kind: Curve(c["knots"], c["base"], c["per_position"]) for kind, c in curves.items()}
        except (KeyError, TypeError) as error:
            raise ValueError(f"a cost curve is incomplete or of the wrong types: {error}") from None
        return cls(built, dict(key))

    def save(self, path: str | Path) -> None:
        """Write to `path` atomically (a temporary file beside it, renamed): a reader never sees half a file. OSError
        when the folder cannot be made or written (the temporary file is removed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as out:
            try:
                json.dump(self.to_dict(), out)
            except BaseException:
                out.close()
                os.unlink(out.name)
                raise
        try:
            os.replace(out.name, path)
        except OSError:
            os.unlink(out.name)
            raise

    @classmethod
    def load(cls, path: str | Path, key: Mapping | None = None) -> CostModel | None:
        """The model saved at `path`, or None if there is none, it is damaged, or (given `key`) it was measured on
        something else: the caller measures again rather than trust it. Reads a regular file of at most
        `MAX_FILE_BYTES` only (a folder, a device such as /dev/zero, a pipe, a huge file: None), and any way the text
        fails to parse (deep nesting included) is None too."""
        try:
            model = cls.from_dict(json.loads(read_small(Path(path), MAX_FILE_BYTES)))
        except (OSError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        if key is not None and model.key != dict(key):
            return None
        return model


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file (after symbolic links) of at most `limit` bytes; OSError or
    ValueError otherwise. Opened without blocking (a named pipe does not wait for a writer), checked on the open file
    (not the name), read at most `limit` + 1 bytes (a file that grows meanwhile is refused, not read whole)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is not a regular file")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data

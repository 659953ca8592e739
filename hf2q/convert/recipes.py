"""Quantization settings and mixed-precision recipes: which precision each weight gets.

What it does: validate ``bits`` / ``group_size`` / ``mode`` against what MLX supports per mode,
load named recipes (``configs/recipes/NAME.toml``) or recipe files, and turn CLI options plus a
recipe plus the model's own mlx-lm predicate into one :class:`Policy` that answers, for a module
path, "quantize with these settings" or "keep in float".

What it does not do: touch tensors (see ``hf2q.convert.plan``).

Recipe format (TOML)::

    description = "what it is for"
    [default]            # optional; CLI --q-bits/--q-group-size/--q-mode override these
    bits = 4
    group_size = 64
    mode = "affine"
    [[rule]]             # first matching rule wins; unmatched modules get the default
    match = 'embed_tokens$|lm_head$'   # regular expression searched in the mlx-lm module path
    bits = 6                            # any of bits / group_size / mode; the rest inherit
    [[rule]]
    match = '\\.(v_proj|down_proj)$'
    first_layers = 0.125                # only in the first / last layers: a fraction of the
    last_layers = 0.125                 # layer count (< 1) or a number of layers (>= 1)
    bits = 6
    [[rule]]
    match = '\\.in_proj_[ab]$'
    quantize = false                    # keep in float (--dtype)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf2q.errors import UsageError
from hf2q.resources import config_file, config_listing

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Quantization modes and what MLX 0.32's ``mx.quantize`` accepts for each: (bits, group sizes),
#: defaults first.
MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "affine": ((4, 2, 3, 5, 6, 8), (64, 32, 128)),
    "mxfp4": ((4,), (32,)),
    "nvfp4": ((4,), (16,)),
    "mxfp8": ((8,), (32,)),
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_RULE_KEYS = {"match", "bits", "group_size", "mode", "quantize", "first_layers", "last_layers"}


@dataclass(frozen=True)
class QuantSpec:
    """How one weight is quantized (``mx.quantize`` arguments)."""

    bits: int
    group_size: int
    mode: str = "affine"

    def as_dict(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @property
    def label(self) -> str:
        if self.mode == "affine":
            return f"affine {self.bits}-bit g{self.group_size}"
        return self.mode


def make_spec(
    bits: int | None = None,
    group_size: int | None = None,
    mode: str | None = None,
    *,
    where: str = "",
) -> QuantSpec:
    """Fill MLX's per-mode defaults and check the combination; raise :class:`UsageError` if invalid.

    Args:
        where: names the origin for the message (``"--q-bits"``, ``"recipe X rule 2"``).
    """
    mode = mode or "affine"
    src = f" ({where})" if where else ""
    if mode not in MODES:
        raise UsageError(f"unknown quantization mode {mode!r}{src}: use one of {', '.join(MODES)}")
    ok_bits, ok_groups = MODES[mode]
    bits = ok_bits[0] if bits is None else int(bits)
    group_size = ok_groups[0] if group_size is None else int(group_size)
    if bits not in ok_bits:
        allowed = ", ".join(str(b) for b in sorted(ok_bits))
        fix = (
            "drop --q-bits or use --q-mode affine" if mode != "affine" else f"use one of {allowed}"
        )
        raise UsageError(f"{mode} quantization takes {allowed} bits, not {bits}{src}: {fix}")
    if group_size not in ok_groups:
        allowed = ", ".join(str(g) for g in sorted(ok_groups))
        fix = (
            "drop --q-group-size (MLX's default for this mode is used)"
            if mode != "affine"
            else f"use one of {allowed}"
        )
        raise UsageError(
            f"{mode} quantization takes group size {allowed}, not {group_size}{src}: {fix}"
        )
    return QuantSpec(bits=bits, group_size=group_size, mode=mode)


@dataclass
class Rule:
    """One recipe rule: where it applies and what it sets."""

    pattern: re.Pattern[str]
    first_layers: float | None = None
    last_layers: float | None = None
    bits: int | None = None
    group_size: int | None = None
    mode: str | None = None
    quantize: bool = True
    index: int = 0

    def applies(self, path: str, num_layers: int) -> bool:
        if not self.pattern.search(path):
            return False
        if self.first_layers is None and self.last_layers is None:
            return True
        m = _LAYER.search(path)
        if m is None:
            return False
        layer = int(m.group(1))
        first = _count(self.first_layers, num_layers)
        last = _count(self.last_layers, num_layers)
        return layer < first or layer >= num_layers - last


def _count(value: float | None, num_layers: int) -> int:
    if value is None:
        return 0
    if value < 1:
        return max(1, int(value * num_layers))
    return int(value)


@dataclass
class Recipe:
    """A named set of per-path precision rules (see the module docstring for the format)."""

    name: str
    description: str = ""
    default: dict[str, Any] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)
    path: Path | None = None


def available_recipes() -> list[str]:
    """Names of the recipes shipped in ``configs/recipes``."""
    return [p.stem for p in config_listing("recipes", "*.toml")]


def load_recipe(name_or_file: str) -> Recipe:
    """Load a shipped recipe by name, or a recipe TOML file by path.

    Raises:
        UsageError: unknown name, unreadable file, or invalid content (message names the fix).
    """
    candidate = Path(name_or_file).expanduser()
    if name_or_file.endswith(".toml") or candidate.is_file():
        if not candidate.is_file():
            raise UsageError(f"recipe file {name_or_file} does not exist: check the --recipe path")
        path = candidate
        name = candidate.stem
    else:
        found = config_file("recipes", f"{name_or_file}.toml")
        if found is None:
            names = ", ".join(available_recipes()) or "none shipped"
            raise UsageError(
                f"unknown recipe {name_or_file!r}: use one of {names}, or pass a recipe .toml file"
            )
        path, name = found, name_or_file
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read recipe {path} ({exc}): check the file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"recipe {path} is not valid TOML ({exc}): fix the file") from exc
    return parse_recipe(data, name=name, path=path)


def parse_recipe(data: dict[str, Any], *, name: str, path: Path | None = None) -> Recipe:
    """Validate a parsed recipe document."""
    where = str(path or name)
    unknown = sorted(set(data) - {"description", "default", "rule"})
    if unknown:
        raise UsageError(
            f"recipe {where} has unknown key(s) {', '.join(unknown)}: use description, [default], [[rule]]"
        )
    default = dict(data.get("default") or {})
    bad = sorted(set(default) - {"bits", "group_size", "mode"})
    if bad:
        raise UsageError(
            f"recipe {where} [default] has unknown key(s) {', '.join(bad)}: use bits, group_size, mode"
        )
    make_spec(where=f"recipe {where} [default]", **default)
    rules = []
    for i, raw in enumerate(data.get("rule") or [], start=1):
        label = f"recipe {where} rule {i}"
        if not isinstance(raw, dict) or "match" not in raw:
            raise UsageError(f"{label} has no 'match': give each [[rule]] a match = 'regex'")
        extra = sorted(set(raw) - _RULE_KEYS)
        if extra:
            raise UsageError(
                f"{label} has unknown key(s) {', '.join(extra)}: use {', '.join(sorted(_RULE_KEYS))}"
            )
        try:
            pattern = re.compile(str(raw["match"]))
        except re.error as exc:
            raise UsageError(
                f"{label} has an invalid regular expression ({exc}): fix 'match'"
            ) from exc
        for key in ("first_layers", "last_layers"):
            if key in raw and (not isinstance(raw[key], (int, float)) or raw[key] <= 0):
                raise UsageError(
                    f"{label}: {key} must be a positive number (fraction < 1 or count)"
                )
        quantize = raw.get("quantize", True)
        if not isinstance(quantize, bool):
            raise UsageError(f"{label}: quantize must be true or false")
        rules.append(
            Rule(
                pattern=pattern,
                first_layers=raw.get("first_layers"),
                last_layers=raw.get("last_layers"),
                bits=raw.get("bits"),
                group_size=raw.get("group_size"),
                mode=raw.get("mode"),
                quantize=quantize,
                index=i,
            )
        )
    return Recipe(
        name=name,
        description=str(data.get("description", "")),
        default=default,
        rules=rules,
        path=path,
    )


#: mlx-lm's per-model predicate: ``(path, module) -> bool | dict``.
ModelPredicate = Callable[[str, Any], "bool | dict[str, Any]"]


class Policy:
    """Decides each module's precision: recipe rules, then the model's own predicate, then default."""

    def __init__(
        self,
        default: QuantSpec | None,
        *,
        recipe: Recipe | None = None,
        model_predicate: ModelPredicate | None = None,
        num_layers: int = 0,
    ) -> None:
        self.default = default
        self.recipe = recipe
        self.model_predicate = model_predicate
        self.num_layers = num_layers
        self._rule_specs: dict[int, QuantSpec] = {}
        if recipe is not None and default is not None:
            for rule in recipe.rules:
                if rule.quantize:
                    self._rule_specs[rule.index] = self._rule_spec(rule)

    def _rule_spec(self, rule: Rule) -> QuantSpec:
        assert self.default is not None and self.recipe is not None
        mode = rule.mode or self.default.mode
        # A rule that changes the mode starts from that mode's defaults, not the body's settings.
        same = mode == self.default.mode
        return make_spec(
            rule.bits if rule.bits is not None else (self.default.bits if same else None),
            rule.group_size
            if rule.group_size is not None
            else (self.default.group_size if same else None),
            mode,
            where=f"recipe {self.recipe.name} rule {rule.index} ({rule.pattern.pattern})",
        )

    def decide(self, path: str, module: Any) -> QuantSpec | None:
        """The precision for quantizable module ``path`` (None: keep it in float)."""
        if self.default is None:
            return None
        if self.recipe is not None:
            for rule in self.recipe.rules:
                if rule.applies(path, self.num_layers):
                    return self._rule_specs.get(rule.index) if rule.quantize else None
        if self.model_predicate is not None:
            verdict = self.model_predicate(path, module)
            if verdict is False:
                return None
            if isinstance(verdict, dict):
                return make_spec(
                    verdict.get("bits"),
                    verdict.get("group_size"),
                    verdict.get("mode", "affine"),
                    where=f"mlx-lm's rule for {path}",
                )
        return self.default

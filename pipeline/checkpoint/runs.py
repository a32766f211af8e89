"""Which run a checkpoint belongs to: its id, its configuration, and what may differ on resume.

A run is one training run across its restarts. Each checkpoint records its
run id and the run's configuration (the caller's JSON-able dict: the Plan,
schedule, seed, optimiser and learning-rate settings, total steps, data
source ...). Resuming compares the recorded configuration with the current
one, key by key (nested dicts as dotted keys, "plan.balance"), and refuses
any difference the caller did not allow:

    saved   {"seed": 0, "lr": 3e-4, "plan": {"balance": [2, 2], "dp": 1}}
    current {"seed": 1, "lr": 3e-4, "plan": {"balance": [4], "dp": 1}}
    allow_changes={"plan.balance"}   ->  refused:  seed: 0 -> 1
    allow_changes={"plan", "seed"}   ->  resumed   (a key allows itself and everything under it)

The id: a save without ``run_id`` continues the run this process last loaded
from, or saved into, the same folder (``remember``); else rank 0 draws a new one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ABSENT", "ConfigMismatch", "allowed", "check", "config_text", "differences", "new_id", "remember",
           "remembered"]  # fmt: skip

ABSENT = "(absent)"
_RUNS: dict[str, str] = {}  # folder -> the id of the run this process continues there


class ConfigMismatch(ValueError):
    """A checkpoint of a run whose configuration differs from the current one."""


def config_text(config: Any) -> str:
    """``config`` as canonical JSON text; a TypeError unless it is a dict that comes back as it went in."""
    if config is None:
        return "null"
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise TypeError(
            f"config must be a dict with str keys (the run's settings), got {type(config).__name__}; "
            "pass e.g. {'plan': plan.to_json(), 'seed': 0, 'lr': 3e-4, 'steps': 1000}"
        )
    try:
        text = json.dumps(config, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"config must be JSON-able: {exc}; convert the value first (e.g. str(path))") from exc
    if json.loads(text) != config:
        raise TypeError(f"config {config!r} would load as {json.loads(text)!r}; use lists and str dict keys")
    return text


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value} if prefix else {}


def differences(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each dotted key whose value differs: (saved, current), ``ABSENT`` where one side lacks it."""
    old, new = _flat(saved or {}), _flat(current)
    return {
        key: (old.get(key, ABSENT), new.get(key, ABSENT))
        for key in sorted(old.keys() | new.keys())
        if old.get(key, ABSENT) != new.get(key, ABSENT)
    }


def allowed(key: str, allow_changes: Iterable[str]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allow_changes)


def _line(key: str, saved: Any, current: Any) -> str:
    def show(v: Any) -> str:
        return v if v is ABSENT else json.dumps(v)

    return f"{key}: {show(saved)} -> {show(current)}"


def check(
    saved: Mapping[str, Any] | None, current: Mapping[str, Any], allow_changes: Iterable[str], where: str
) -> list[str]:
    """The allowed changes ("key: saved -> current"); a ConfigMismatch listing every other difference."""
    if isinstance(allow_changes, str) or not all(isinstance(a, str) for a in allow_changes):
        raise TypeError(  # a str would allow its letters
            f"allow_changes must be a set of config keys (e.g. {{'dp', 'plan'}}), got {allow_changes!r}"
        )
    allow = set(allow_changes)
    keys = _flat(saved or {}).keys() | _flat(current).keys()
    unknown = sorted(a for a in allow if not any(k == a or k.startswith(f"{a}.") for k in keys))
    if unknown:
        raise ValueError(
            f"allow_changes names {unknown}, which neither the saved nor the current config has; "
            f"its keys are {sorted(keys)}"
        )
    diff = differences(saved, current)
    refused = [_line(k, *v) for k, v in diff.items() if not allowed(k, allow)]
    if refused:
        recorded = "" if saved is not None else " (it records no config: it was saved without config=)"
        raise ConfigMismatch(
            f"checkpoint {where} belongs to a run with another configuration{recorded}; "
            f"{len(refused)} difference(s) (key: saved -> current):\n  " + "\n  ".join(refused) + "\n"
            "resume with the saved configuration, use another folder for a new run, or pass "
            f"allow_changes={{{', '.join(repr(k) for k in diff if not allowed(k, allow))}}} "
            "for deliberate changes"
        )
    return [_line(k, *v) for k, v in diff.items()]


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def _key(root: Path) -> str:
    return str(root.resolve())


def remember(root: Path, run_id: str) -> None:
    _RUNS[_key(root)] = run_id


def remembered(root: Path) -> str | None:
    return _RUNS.get(_key(root))

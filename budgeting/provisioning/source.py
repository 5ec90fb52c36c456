"""A provisioning file: reading it (typed access naming the path of every bad field), and the name the change
log gives it (the file and its digest)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from budgeting.catalog.changes import Actor

T = TypeVar("T")

ACTOR_PREFIX = "provision:"
"""Change-log usernames of provisioning files start with this."""


class ProvisioningError(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class Source:
    """The file a plan comes from: its name and the sha256 of its bytes."""

    name: str
    digest: str

    @classmethod
    def of_document(cls, document: Any) -> Source:
        """For a document that was not read from a file: named by the digest of its canonical JSON."""
        canonical = json.dumps(document, sort_keys=True, default=str).encode()
        return cls("document", hashlib.sha256(canonical).hexdigest())

    @property
    def actor(self) -> Actor:
        """Who the change log says made the file's changes: ``provision:demo.yaml@sha256:3f2a9c1d04be``."""
        return Actor(user_id=None, username=f"{ACTOR_PREFIX}{self.name[:100]}@sha256:{self.digest[:12]}")

    @property
    def reason(self) -> str:
        return f"applied from provisioning file {self.name} (sha256:{self.digest})"


@dataclass(frozen=True)
class Loaded:
    document: Any
    source: Source


def load(path: Path) -> Loaded:
    """Read a JSON or YAML provisioning file. Raises ProvisioningError for unreadable or malformed files."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ProvisioningError(str(path), f"cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
        document = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ProvisioningError(str(path), f"not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None
    return Loaded(document, Source(path.name, hashlib.sha256(raw).hexdigest()))


def load_file(path: Path) -> Any:
    """The document of a provisioning file (see ``load``)."""
    return load(path).document


class Reader:
    """Typed access to one mapping of the document, naming the path of every bad field."""

    def __init__(self, data: Any, path: str, allowed: set[str]) -> None:
        if not isinstance(data, dict):
            raise ProvisioningError(path, "must be a mapping")
        unknown = set(data) - allowed
        if unknown:
            raise ProvisioningError(f"{path}.{sorted(unknown)[0]}", "unknown field")
        self.data = data
        self.path = path

    def get(self, key: str, kind: type[T], default: T | None = None, *, required: bool = False) -> T:
        if key not in self.data or self.data[key] is None:
            if required:
                raise ProvisioningError(f"{self.path}.{key}", "is required")
            return default  # type: ignore[return-value]
        value = self.data[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ProvisioningError(f"{self.path}.{key}", f"must be an integer, got {value!r}")
        if not isinstance(value, kind):
            raise ProvisioningError(
                f"{self.path}.{key}", f"must be {kind.__name__}, got {type(value).__name__}"
            )
        return value

    def positive(self, key: str, *, required: bool = True, allow_zero: bool = False) -> int | None:
        value = self.get(key, int, required=required)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise ProvisioningError(f"{self.path}.{key}", f"must be {'>= 0' if allow_zero else '> 0'}")
        return value

    def choice(self, key: str, choices: set[str], default: str | None = None) -> str:
        value = self.get(key, str, default, required=default is None)
        if value not in choices:
            raise ProvisioningError(f"{self.path}.{key}", f"must be one of {sorted(choices)}, got {value!r}")
        return value

    def ref(self, key: str, known: set[Any], kind: str) -> Any:
        """A required reference to another object, by its natural key."""
        value = self.data.get(key)
        if value is None:
            raise ProvisioningError(f"{self.path}.{key}", "is required")
        if value not in known:
            raise ProvisioningError(f"{self.path}.{key}", f"unknown {kind} {value!r}")
        return value

    def refs(self, key: str, known: set[Any], kind: str, *, required: bool = False) -> list[Any]:
        """A list of references, sorted (the order of a many-to-many means nothing)."""
        values = self.get(key, list, [], required=required)
        for value in values:
            if not isinstance(value, str) or value not in known:
                raise ProvisioningError(f"{self.path}.{key}", f"unknown {kind} {value!r}")
        return sorted(set(values))


def items(doc: dict[str, Any], key: str) -> list[tuple[str, Any]]:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise ProvisioningError(key, "must be a list")
    return [(f"{key}[{i}]", item) for i, item in enumerate(value)]

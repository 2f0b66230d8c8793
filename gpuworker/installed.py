"""The models installed on this GPU host: every `MODELS_DIR/*/manifest.json`, parsed with the
contract's manifest rules, `source` resolved against each file's folder (plain data, no Django);
docs/protocol.md, "Model manifest"."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potocolom.protocol.manifests import Manifest, ManifestError, parse_manifest_file

MANIFEST_NAME = "manifest.json"


class UnknownModelError(ValueError):
    """--models names a model that is not installed in the models dir."""


@dataclass(frozen=True)
class ModelOnDisk:
    """One manifest entry, with `source` resolved against the manifest's folder."""

    model_id: str
    pipeline: str  # a diffusers pipeline class name, e.g. "StableDiffusionPipeline"
    source: str  # an absolute folder, or a hub id when no such folder exists
    manifest_path: Path
    tier: str = "draft"
    cost: float = 1.0
    capabilities: tuple[str, ...] = ("txt2img",)
    params_schema: dict[str, Any] = field(default_factory=dict)

    @property
    def source_is_local(self) -> bool:
        return Path(self.source).is_dir()

    @classmethod
    def of(cls, manifest: Manifest, manifest_path: Path) -> ModelOnDisk:
        return cls(model_id=manifest.model_id, pipeline=manifest.pipeline,
                   source=_resolve_source(manifest_path, manifest.source), manifest_path=manifest_path,
                   tier=manifest.tier, cost=manifest.cost, capabilities=manifest.capabilities,
                   params_schema=manifest.params_schema)


def _resolve_source(manifest_path: Path, source: str) -> str:
    """A folder relative to the manifest file (or absolute) when it exists; else the raw hub id."""
    candidate = Path(source).expanduser()
    if not candidate.is_absolute():
        candidate = manifest_path.parent / candidate
    if candidate.is_dir() or Path(source).is_absolute() or source.startswith("."):
        return str(candidate.resolve())
    return source


def read_manifest(path: str | Path) -> list[ModelOnDisk]:
    """The models one manifest file describes (an object or a list of objects)."""
    manifest_path = Path(path).resolve()
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{manifest_path}: cannot be read ({exc.strerror})") from None
    return [ModelOnDisk.of(m, manifest_path) for m in parse_manifest_file(data, origin=str(manifest_path))]


def parse_model_ids(text: str | None) -> list[str] | None:
    """`--models a,b` as ["a", "b"]; None (serve everything) when not given or blank."""
    if text is None:
        return None
    ids = [part.strip() for part in text.split(",") if part.strip()]
    return ids or None


def discover_models(models_dir: str | Path, only: Iterable[str] | None = None) -> list[ModelOnDisk]:
    """The installed models, sorted by model_id; `only` (from --models) narrows them.

    Raises ManifestError for a bad manifest or a model_id installed twice, and UnknownModelError
    when `only` names a model that is not installed.
    """
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ManifestError(f"the models dir {root} does not exist or is not a folder")
    found: dict[str, ModelOnDisk] = {}
    for manifest_path in sorted(root.glob(f"*/{MANIFEST_NAME}")):
        for model in read_manifest(manifest_path):
            if model.model_id in found:
                raise ManifestError(f"model {model.model_id!r} is installed twice: in "
                                    f"{found[model.model_id].manifest_path} and {model.manifest_path}")
            found[model.model_id] = model
    if only is None:
        return [found[key] for key in sorted(found)]
    wanted = list(dict.fromkeys(only))
    unknown = [model_id for model_id in wanted if model_id not in found]
    if unknown:
        installed = ", ".join(sorted(found)) or "none"
        raise UnknownModelError(f"--models names model(s) not installed in {root}: {', '.join(unknown)} "
                                f"(installed: {installed})")
    return [found[model_id] for model_id in sorted(wanted)]

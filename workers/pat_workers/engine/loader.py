"""Reads and writes Hugging Face model directories: config.json, *.safetensors (single or sharded), tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from .config import ConfigError, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise ConfigError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def load_weights(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the model, in `dtype` on `device`; names as Hugging Face writes them."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        for name, tensor in load_file(str(file), device=str(device)).items():
            tensors[name] = tensor.to(dtype)
    return tensors


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the files' headers (no weight is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    return shapes


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(ModelConfig, weights) of a model directory."""
    return ModelConfig.from_dir(path), load_weights(path, dtype, device)


def load_tokenizer(path: str | Path) -> Tokenizer:
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"{file}: not found; the engine needs the fast tokenizer file (tokenizer.json)")
    return Tokenizer.from_file(str(file))


def save_weights(path: str | Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Writes model.safetensors, or `shards` files plus the index that transformers writes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shards == 1:
        save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

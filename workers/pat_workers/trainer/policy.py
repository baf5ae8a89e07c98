"""The trained policy: a model directory's weights as torch Parameters, computed by the engine's Transformer.

One model implementation serves generation and training: the forward here is engine/model.py's, run over
the Parameters (model.Transformer.causal_logits), so what the trainer optimises is what the generator samples.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from ..engine.loader import INDEX_FILE, load_model, save_weights
from ..engine.model import Transformer
from .grpo import entropy


class Policy(torch.nn.Module):
    """Parameters named as Hugging Face names them: each dotted name is a path of submodules, so that
    named_parameters() and state_dict() give the Hugging Face names (model.layers.0.mlp.up_proj.weight).

    The device is fixed at construction (the engine's RoPE tables live there). A frozen reference policy is
    Policy(path).requires_grad_(False).
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__()
        self.model_dir = Path(model_dir)
        self.config, weights = load_model(model_dir, dtype, device)
        for name in sorted(weights):
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, torch.nn.Parameter(weights[name]))
        # The engine reads the Parameters themselves: its views (built per forward) carry their gradients.
        self.transformer = Transformer(self.config, dict(self.named_parameters()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] at every position of right-padded rows [B, T] (a full causal pass)."""
        return self.transformer.causal_logits(tokens)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Detached views of the weights (they change with the next step; clone to keep), by Hugging Face name in
        sorted-name order (the order weight sync sends them in)."""
        return {name: p.detach() for name, p in sorted(self.named_parameters())}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies `weights` (Hugging Face names, every weight of this model) into the Parameters in place."""
        params = dict(self.named_parameters())
        missing, unexpected = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
        if missing or unexpected:
            raise ValueError(f"weights do not match the model in {self.model_dir}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}; load weights saved from this model")
        with torch.no_grad():
            for name, p in params.items():
                if weights[name].shape != p.shape:
                    raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, the model "
                                     f"{tuple(p.shape)}; load weights saved from this model")
                p.copy_(weights[name])

    def save_pretrained(self, path: str | Path) -> Path:
        """A model directory the engine loads: the source's JSON files (config.json, tokenizer.json, ...) and
        the current weights as model.safetensors."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for file in self.model_dir.glob("*.json"):
            if file.name != INDEX_FILE:  # the weights are written unsharded
                shutil.copy2(file, path / file.name)
        save_weights(path, self.named_weights())
        return path


class ResponseLogprobs(NamedTuple):
    logprobs: torch.Tensor  # [B, R]: log p(token | prefix) of each response token; 0 past a response's end
    mask: torch.Tensor  # [B, R] bool: True at response tokens
    entropy: torch.Tensor  # scalar: mean next-token entropy over the response tokens (detached, for logging)


def response_logprobs(model: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                      prompt_lens: Sequence[int] | torch.Tensor,
                      response_lens: Sequence[int] | torch.Tensor) -> ResponseLogprobs:
    """Scores rows [B, L] of prompt + response tokens, right-padded; R = max(response_lens).

    `model` maps tokens to logits [B, L, V]: a Policy, or a Policy wrapped in DistributedDataParallel -- call
    through the wrapper, since DDP all-reduces gradients only for passes through its own forward. The
    log-probabilities are of the raw logits (temperature 1), as the engine reports them for sampled tokens.
    """
    b, length = tokens.shape
    prompt_lens = torch.as_tensor(prompt_lens, device=tokens.device)
    response_lens = torch.as_tensor(response_lens, device=tokens.device)
    if prompt_lens.shape != (b,) or response_lens.shape != (b,):
        raise ValueError(f"prompt_lens and response_lens need one entry per row ({b}); got "
                         f"{tuple(prompt_lens.shape)} and {tuple(response_lens.shape)}")
    if (prompt_lens < 1).any() or (response_lens < 0).any() or (prompt_lens + response_lens > length).any():
        raise ValueError(f"each row needs prompt_len >= 1 (a token to predict the first response token from), "
                         f"response_len >= 0 and prompt_len + response_len <= {length} (the row length)")
    logits = model(tokens)
    offsets = torch.arange(int(response_lens.max()), device=tokens.device)
    mask = offsets < response_lens[:, None]
    positions = (prompt_lens[:, None] + offsets).clamp(max=length - 1)  # [B, R]; past the end: masked
    rows = torch.arange(b, device=tokens.device)[:, None]
    predicting = logits[rows, positions - 1]  # [B, R, V]: each response token is predicted one position earlier
    # At least float32: bfloat16 log-probabilities are too coarse for the PPO ratio.
    logp = torch.log_softmax(predicting, dim=-1, dtype=torch.promote_types(predicting.dtype, torch.float32))
    chosen = logp.gather(-1, tokens[rows, positions][..., None])[..., 0]
    with torch.no_grad():
        mean_entropy = entropy(predicting, mask)
    return ResponseLogprobs(chosen.masked_fill(~mask, 0.0), mask, mean_entropy)

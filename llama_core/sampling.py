"""Temperature and nucleus (top-p) sampling as pure functions over logits."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .errors import InvalidRequestError

Param = Union[float, torch.Tensor]


def validate_sampling(temperature: float, top_p: float) -> None:
    """Raises InvalidRequestError unless temperature >= 0 and 0 < top_p <= 1 (both finite numbers)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be a number in (0, 1], got {top_p!r}")


def top_p_filter(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p, renormalised.

    Args:
        probs: [B, V] probabilities.
        top_p: a float, or [B] per row.
    """
    top_p = _column(top_p, probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat((torch.zeros_like(mass_before[:, :1]), mass_before[:, :-1]), dim=-1)
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def logits_to_probs(logits: torch.Tensor, temperature: Param, top_p: Param) -> torch.Tensor:
    """Softmax of logits / temperature, filtered to top_p. Rows with temperature 0 are left to the caller."""
    temperature = _column(temperature, logits).clamp_min(1e-5)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return top_p_filter(probs, top_p)


def draw(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of probs [B, V], drawn without a host synchronisation (exponential race)."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / race, dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: Param,
    top_p: Param,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next token for each row of logits [B, V]: argmax where temperature is 0, else a top-p draw."""
    greedy = torch.argmax(logits, dim=-1)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    drawn = draw(logits_to_probs(logits, temperature, top_p), generator)
    if isinstance(temperature, (int, float)):
        return drawn
    return torch.where(temperature.to(logits.device) == 0, greedy, drawn)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Natural-log probability of tokens [...] under logits [..., V] (the model's own distribution)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def _column(value: Param, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float32).reshape(-1, 1)
    return torch.full((1, 1), float(value), device=like.device)

"""Helpers for tests that save and load real checkpoints through a mount.

* deterministic PyTorch model + optimizer state (``torch_train_state``) and plain tensor
  dicts (``tensor_state``) with control over which tensors change between steps;
* ``assert_same`` compares two nested state dicts bit for bit (``torch.equal`` on every
  tensor, dtype and shape included; ``==`` on everything else);
* ``chunk_digests`` cuts bytes into the chunks mtcfs would make, to find a chunk object in
  the backup tier.
"""

from __future__ import annotations

from typing import Any

import blake3


def torch_train_state(seed: int, width: int = 128, steps: int = 2):
    """A small MLP and an Adam optimizer after ``steps`` deterministic training steps.

    Returns:
        (model, optimizer)
    """
    import torch
    import torch.nn as nn

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def dcp_state(model, opt) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` in DCP's canonical (FQN-keyed) form."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def apply_dcp_state(model, opt, state: dict[str, Any]) -> None:
    """Load a state produced by :func:`dcp_state` (after ``dcp.load``) into model/opt."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def tensor_state(n: int, numel: int, seed: int, changed: dict[int, int] | None = None):
    """``{"t00": tensor, ...}``: ``n`` float32 tensors of ``numel`` elements each.

    Tensor ``i`` is drawn from seed ``(seed, i)``, or ``(changed[i], i)`` when ``i`` is in
    ``changed`` (so a later step can differ from an earlier one in chosen tensors only).
    """
    import torch

    changed = changed or {}
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(changed.get(i, seed) * 1000 + i)
        out[f"t{i:02d}"] = torch.randn(numel, generator=g, dtype=torch.float32)
    return out


def zeros_like_state(state: Any) -> Any:
    """Same structure, every tensor replaced by zeros (a target for ``dcp.load``)."""
    import torch

    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Assert two nested state dicts are bit-identical (every tensor via torch.equal)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def count_tensors(state: Any) -> int:
    import torch

    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_tensors(v) for v in state)
    return int(isinstance(state, torch.Tensor))


def chunk_digests(data: bytes, chunk_size: int) -> list[str]:
    """blake3 hex digest of each fixed-size chunk of ``data`` (as mtcfs cuts files)."""
    return [blake3.blake3(data[i:i + chunk_size]).hexdigest()
            for i in range(0, len(data), chunk_size)]


def dcp_load_like(path, like: Any) -> Any:
    """Load the DCP checkpoint at ``path`` into zeros shaped like ``like``; returns it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    target = zeros_like_state(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP warns it runs single-rank
        dcp.load(target, checkpoint_id=str(path))
    return target

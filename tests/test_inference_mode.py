"""server.inference_mode.hot_inference_mode: the call runs in torch inference mode whether or not the
caller holds it, the caller's mode is as it was afterwards (also after a raise), and a caller that
holds it makes the wrapper enter nothing."""
from __future__ import annotations

import pytest
import torch

import server.inference_mode as im
from server.inference_mode import hot_inference_mode


@hot_inference_mode
def _probe(x: torch.Tensor) -> tuple[bool, torch.Tensor]:
    return torch.is_inference_mode_enabled(), x * 2


@hot_inference_mode
def _raises() -> None:
    raise ValueError("from inside")


def test_the_call_runs_in_inference_mode_either_way() -> None:
    assert not torch.is_inference_mode_enabled()
    on, y = _probe(torch.ones(2))
    assert on and y.is_inference() and not torch.is_inference_mode_enabled()
    with torch.inference_mode():
        on, y = _probe(torch.ones(2))
        assert on and y.is_inference() and torch.is_inference_mode_enabled()
    with pytest.raises(ValueError, match="from inside"):
        _raises()
    assert not torch.is_inference_mode_enabled()
    assert _probe.__name__ == "_probe"  # functools.wraps


def test_a_caller_holding_the_mode_makes_it_enter_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    entered = []
    real = torch.inference_mode

    def counting(*a: object) -> object:
        entered.append(1)
        return real(*a)  # type: ignore[arg-type]

    with real():
        monkeypatch.setattr(im.torch, "inference_mode", counting)
        for _ in range(3):
            _probe(torch.ones(1))
        assert entered == []
    _probe(torch.ones(1))  # outside: entered once
    assert entered == [1]

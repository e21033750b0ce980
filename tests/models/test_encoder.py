import pytest
import torch

from titans.models import ClassificationHead, ForecastHead, RegressionHead, TitansEncoder


def test_encoder_shapes_streaming_and_heads():
    torch.manual_seed(0)
    enc = TitansEncoder(embed_dim=3, hidden_size=16, memory_size=32, num_layers=2, window_size=5, heads=2).double()
    x = torch.randn(2, 17, 3, dtype=torch.float64)
    last, state = enc(x)
    assert last.shape == (2, 16)
    h1, s = enc.hidden_states(x[:, :6])
    h2, _ = enc.hidden_states(x[:, 6:], s)
    full, _ = enc.hidden_states(x)
    assert (torch.cat([h1, h2], 1) - full).abs().max() <= 1e-10
    assert ClassificationHead(enc, 5).double()(x)[0].shape == (2, 5)
    assert RegressionHead(enc).double()(x)[0].shape == (2, 1)
    forecaster = ForecastHead(enc).double()
    assert forecaster(x)[0].shape == (2, 17, 3)
    loss = forecaster.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    assert enc.input_proj.weight.grad.abs().sum() > 0


def test_encoder_rejects_wrong_width():
    enc = TitansEncoder(embed_dim=3, hidden_size=16, heads=2)
    with pytest.raises(ValueError, match="x must be"):
        enc(torch.randn(1, 4, 5))

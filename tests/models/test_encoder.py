import pytest
import torch

from titans.models import ClassificationHead, ForecastHead, RegressionHead, TitansEncoder

DT = torch.float64


def test_encoder_options_map_onto_the_config():
    enc = TitansEncoder(embed_dim=3, hidden_size=16, memory_size=32, num_layers=3, dropout=0.1, momentum=False,
                        window_size=5, heads=2, variant="mac")
    cfg = enc.config
    assert (cfg.dim, cfg.depth, cfg.dropout, cfg.memory.momentum, cfg.attention.window, cfg.attention.segment_len) == \
        (16, 3, 0.1, False, 5, 5)
    assert cfg.memory.expansion == 4  # memory_size 32 over heads of width 16 / 2 = 8
    assert enc.backbone.blocks[0].mixer.memory.initial_weights[0].shape == (2, 8, 32)
    assert not enc.backbone.blocks[0].mixer.memory.rule.momentum
    # config overrides reach the memory, flat or nested
    enc = TitansEncoder(embed_dim=3, hidden_size=16, heads=2, memory_heads=1, memory={"loss": "huber"})
    assert (enc.config.memory.heads, enc.config.memory.loss.name) == (1, "huber")


def test_encoder_shapes_streaming_and_heads():
    torch.manual_seed(0)
    enc = TitansEncoder(embed_dim=3, hidden_size=16, memory_size=32, num_layers=2, window_size=5, heads=2).to(DT)
    x = torch.randn(2, 17, 3, dtype=DT)
    last, _ = enc(x)
    full, _ = enc.hidden_states(x)
    assert last.shape == (2, 16) and torch.equal(last, full[:, -1])
    h1, state = enc.hidden_states(x[:, :6])
    h2, _ = enc.hidden_states(x[:, 6:], state)
    assert (torch.cat([h1, h2], 1) - full).abs().max() <= 1e-10
    x2 = x.clone()
    x2[:, 9] += 1.0  # causal: positions before 9 do not move
    assert torch.equal(enc.hidden_states(x2)[0][:, :9], full[:, :9])
    classifier = ClassificationHead(enc, 5).to(DT)
    assert classifier(x)[0].shape == (2, 5)
    assert classifier.loss(x, torch.tensor([0, 4])).item() > 0
    assert RegressionHead(enc, 2).to(DT)(x)[0].shape == (2, 2)
    regressor = RegressionHead(enc).to(DT)
    assert regressor.loss(x, torch.ones(2, 1, dtype=DT)).item() > 0
    with pytest.raises(ValueError, match="targets"):  # [B] against [B, 1] would broadcast to a [B, B] grid
        regressor.loss(x, torch.ones(2, dtype=DT))
    forecaster = ForecastHead(enc).to(DT)
    assert forecaster(x)[0].shape == (2, 17, 3)
    forecaster.loss(x[:, :-1], x[:, 1:]).backward()
    assert enc.input_proj.weight.grad.abs().sum() > 0


def test_forecaster_learns_a_sine():
    """One-step-ahead forecasts of sines with random phase: MSE far below the series' variance (0.5)."""
    torch.manual_seed(0)
    forecaster = ForecastHead(TitansEncoder(embed_dim=1, hidden_size=16, num_layers=1, window_size=8, heads=2,
                                            variant="mal", chunk_size=4))
    optimizer = torch.optim.Adam(forecaster.parameters(), lr=0.01)
    t = torch.arange(17.0)

    def series(n):
        return torch.sin(0.5 * t + 6.3 * torch.rand(n, 1))[..., None]

    for _ in range(80):
        x = series(32)
        loss = forecaster.loss(x[:, :-1], x[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    x = series(128)
    with torch.no_grad():
        assert forecaster.loss(x[:, :-1], x[:, 1:]).item() < 0.02


@pytest.mark.parametrize("options, name", [
    (dict(hidden_size=15), "hidden_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(window_size=0), "window_size"),
    (dict(memory_size=4), "memory_size"),
    (dict(embed_dim=0), "embed_dim"),
])
def test_bad_encoder_options_name_the_option(options, name):
    with pytest.raises(ValueError, match=name):
        TitansEncoder(**{"embed_dim": 3, "hidden_size": 16, "heads": 2, **options})


def test_encoder_rejects_wrong_width():
    enc = TitansEncoder(embed_dim=3, hidden_size=16, heads=2)
    with pytest.raises(ValueError, match="x must be"):
        enc(torch.randn(1, 4, 5))

"""Every variant: causality, streaming in pieces, cached generation, bounded state, parameter parity,
save/load, bad configs. Tiny models in float64 so equalities can be tight."""

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from titans import TitansConfig, TitansLM
from titans.experiments.spec import model_field
from titans.io import state as state_io
from titans.io.pretrained import FORMAT_VERSION
from titans.io.state import _flatten
from titans.layers import states_trusted, trusted_states
from titans.layers.attention import reference_window_attention
from titans.memory import NeuralMemory
from titans.models import VARIANTS, load_state, sample_next, save_state
from titans.models.config import (
    FLAT_ATTENTION_FIELDS,
    FLAT_MEMORY_FIELDS,
    MAC_PAPER_ORDER,
    MAC_SWITCHES,
    UNREAD_FIELDS,
    unread_fields,
)
from titans.train.config import OptimConfig
from titans.train.loop import make_optimizer

DT = torch.float64
VOCAB = 32
# window 5, MAC segment 6, memory chunk 4: sequences of ~20 tokens cross every boundary several times.
TINY = dict(vocab_size=VOCAB, dim=16, depth=2, heads=2, window=5, segment_len=6, n_persistent=2, chunk_size=4)


def tiny_model(variant: str, **overrides) -> TitansLM:
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant=variant, **{**TINY, **overrides})).to(DT)
    with torch.no_grad():  # gates away from their init so that every memory term matters
        for name, p in model.named_parameters():
            if name.endswith("to_gates.weight"):
                p.normal_(0, 0.3)
            if name.endswith("context_norm"):  # MAC's context read away from the gate read's norm (both start at 1)
                p.normal_(1, 0.3)
    return model.eval()


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def model(variant):
    return tiny_model(variant)


def test_causality(model):
    assert_causal(model)


def assert_causal(model):
    x = tokens(2, 20)
    logits, _ = model(x)
    for j in (0, 7, 13, 19):
        changed = x.clone()
        changed[:, j] = (changed[:, j] + 5) % VOCAB
        logits2, _ = model(changed)
        assert torch.equal(logits2[:, :j], logits[:, :j]), f"position {j} leaked backwards"
        assert (logits2[:, j] - logits[:, j]).abs().max() > 1e-6


@pytest.mark.parametrize("cuts", [[1, 4, 7, 13, 18], [3, 9, 10, 11, 17]])
def test_pieces_with_state_equal_one_call(model, cuts):
    """Odd piece sizes cross memory chunks (4), MAC segments (6) and the attention window (5)."""
    assert_pieces_equal_one_call(model, cuts)


def assert_pieces_equal_one_call(model, cuts):
    x = tokens(2, 20, seed=1)
    logits, _ = model(x)
    state, pieces = None, []
    bounds = [0, *cuts, 20]
    for a, b in zip(bounds, bounds[1:]):
        piece, state = model(x[:, a:b], state)
        pieces.append(piece)
    assert (torch.cat(pieces, 1) - logits).abs().max() <= 1e-10


@pytest.mark.parametrize("variant_name", ["swa", "mag"])
def test_long_sequence_through_the_banded_path_streams_exactly(variant_name):
    """Long enough that the sliding window runs in query blocks (> 64 + window keys)."""
    model = tiny_model(variant_name, depth=1)
    x = tokens(1, 90, seed=2)
    logits, _ = model(x)
    first, state = model(x[:, :41])
    second, _ = model(x[:, 41:], state)
    assert (torch.cat([first, second], 1) - logits).abs().max() <= 1e-10


def test_cached_generation_equals_full_forward(model):
    """Greedy: the logits generate() computes at every step equal one forward over the whole output."""
    step_logits = []
    hook = model.head.register_forward_hook(lambda module, args, out: step_logits.append(out))
    try:
        prompt = tokens(2, 7, seed=3)
        out = model.generate(prompt, max_new_tokens=10, temperature=0.0)
    finally:
        hook.remove()
    assert out.shape == (2, 17) and torch.equal(out[:, :7], prompt)
    cached = torch.cat(step_logits, 1)  # the prompt's logits, then one step per new token
    full, _ = model(out)
    assert cached.shape == full.shape
    assert (cached - full).abs().max() <= 1e-10
    assert torch.equal(full[:, 6:-1].argmax(-1), out[:, 7:])


def state_numel(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if hasattr(obj, "__dataclass_fields__"):
        return sum(state_numel(getattr(obj, name)) for name in obj.__dataclass_fields__)
    if isinstance(obj, (list, tuple)):
        return sum(state_numel(item) for item in obj)
    return 0


def test_state_size_is_bounded(model, variant):
    """After 16 and 40 tokens (same offsets in chunks and segments) the state has the same size: attention
    caches stop at the window/segment, memory states are constant. Only full attention grows."""
    _, generated = model.generate(tokens(1, 4), max_new_tokens=12, temperature=0.0, return_state=True)
    memorized = model.memorize(tokens(1, 40))
    if variant == "transformer":
        assert state_numel(memorized) == state_numel(generated) + 24 * 2 * 2 * 16  # 24 more K and V, 2 layers
    else:
        assert state_numel(memorized) == state_numel(generated)


def test_state_save_load_round_trip(model, tmp_path):
    state = model.memorize(tokens(2, 11))
    save_state(state, tmp_path / "state.safetensors")
    loaded = load_state(tmp_path / "state.safetensors")
    query = tokens(2, 7, seed=4)
    assert torch.equal(model(query, state)[0], model(query, loaded)[0])


# (state's variant, model's variant, what the error names); MAG and MAL states share a structure (next test)
ANOTHER_MODEL = [
    ("lmm", "mal", "MALMixer continues from a state of type AttentionMemoryState, got MemoryState"),
    ("mac", "lmm", "NeuralMemory continues from a state of type MemoryState, got MACState"),
    ("mag", "mac", "MACMixer continues from a state of type MACState, got AttentionMemoryState"),
    ("lmm", "lstm", "LSTMMixer continues from a state of type LSTMState, got MemoryState"),
    ("lstm", "swa", "Attention continues from a state of type KVCache, got LSTMState"),
    ("swa", "transformer", "state.k holds 5 keys, but full attention keeps 12 after 12 tokens"),
    ("gated_deltanet", "lmm", "state holds 1 weight and 1 momentum layers, this memory has 2"),
]


@pytest.mark.parametrize("source, target, message", ANOTHER_MODEL)
def test_a_state_from_another_model_is_refused(source, target, message):
    state = tiny_model(source).memorize(tokens(1, 12))
    with pytest.raises(ValueError, match=message):
        tiny_model(target)(tokens(1, 3), state)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_state_from_another_batch_or_size_is_refused(variant):
    state = tiny_model(variant).memorize(tokens(2, 12))
    with pytest.raises(ValueError, match="has shape .*, expected .*another batch size"):
        tiny_model(variant)(tokens(3, 3), state)
    with pytest.raises(ValueError, match="has shape .*, expected .*another size"):
        tiny_model(variant, dim=32)(tokens(2, 3), state)
    if variant in ("mag", "mal"):  # the prefix keys are the only trace of n_persistent in their state
        with pytest.raises(ValueError, match="holds 2 persistent-token keys, this model has 3"):
            tiny_model(variant, n_persistent=3)(tokens(2, 3), state)


def test_generation_checks_the_callers_state_and_trusts_only_its_own():
    """generate() skips the state checks only for the states it made itself: a state from another batch size is
    refused at the prompt, and the trust ends with the call (also when it fails)."""
    state = tiny_model("mac").memorize(tokens(2, 12))
    with pytest.raises(ValueError, match="another batch size"):
        tiny_model("mac").generate(tokens(3, 3), 4, temperature=0.0, state=state)
    assert not states_trusted()
    with trusted_states():
        assert states_trusted()
    with pytest.raises(ValueError, match="another batch size"):
        tiny_model("mac")(tokens(3, 3), state)


def test_a_state_file_records_its_model(tmp_path):
    mag, mal = tiny_model("mag"), tiny_model("mal")
    path = tmp_path / "state.safetensors"
    save_state(mag.memorize(tokens(1, 9)), path, config=mag.config)
    query = tokens(1, 4, seed=2)
    assert torch.equal(mag(query, load_state(path, config=mag.config))[0], mag(query, load_state(path))[0])
    assert load_state(path, config=tiny_model("mag", dropout=0.1).config) is not None  # dropout: not the state's
    with pytest.raises(ValueError, match="another model: variant='mag' \\(this model: 'mal'\\)"):
        load_state(path, config=mal.config)  # same structure: only the record tells them apart
    with pytest.raises(ValueError, match="another model: attention.window=5 \\(this model: 7\\)$"):
        load_state(path, config=tiny_model("mag", window=7).config)
    save_state(mag.memorize(tokens(1, 9)), tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="records no model config"):
        load_state(tmp_path / "bare.safetensors", config=mag.config)
    with pytest.raises(ValueError, match="config must be a titans config"):
        save_state([], tmp_path / "x.safetensors", config={"variant": "mag"})


def test_a_state_file_recorded_before_the_attention_section_loads(tmp_path, monkeypatch):
    """A state saved when the attention's fields were flat (config.json format 3) is the same model's: its record
    reads as the config reads flat names today."""
    mag = tiny_model("mag")
    record = state_io._config_dict(mag.config)
    record["fields"].update(record["fields"].pop("attention"))  # window, segment_len, ... at the top, as then
    monkeypatch.setattr(state_io, "_config_dict", lambda config: record)
    path = tmp_path / "flat.safetensors"
    save_state(mag.memorize(tokens(1, 9)), path, config=mag.config)
    monkeypatch.undo()
    assert "window" in json.loads(safe_open(path, "pt").metadata()[state_io.CONFIG_KEY])["fields"]
    assert load_state(path, config=mag.config) is not None
    with pytest.raises(ValueError, match="another model: attention.window=5 \\(this model: 7\\)$"):
        load_state(path, config=tiny_model("mag", window=7).config)


def test_save_state_overwrites_nothing_unless_asked(tmp_path):
    model = tiny_model("lmm")
    path = tmp_path / "state.safetensors"
    first, second = model.memorize(tokens(1, 9)), model.memorize(tokens(1, 9, seed=3))
    save_state(first, path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        save_state(second, path)
    with pytest.raises(ValueError, match="is a directory"):
        save_state(second, tmp_path)
    with pytest.raises(ValueError, match="config must be a titans config"):  # a failed save leaves the old file
        save_state(second, path, config={"variant": "lmm"}, overwrite=True)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["state.safetensors"]
    save_state(second, path, overwrite=True)
    query = tokens(1, 4, seed=2)
    assert torch.equal(model(query, load_state(path))[0], model(query, second)[0])


def test_memorize_then_query_equals_one_pass():
    model = tiny_model("mac")
    document, query = tokens(1, 20), tokens(1, 5, seed=5)
    state = model.memorize(document)
    logits_q, _ = model(query, state)
    logits_all, _ = model(torch.cat([document, query], 1))
    assert (logits_q - logits_all[:, 20:]).abs().max() <= 1e-10


@pytest.mark.parametrize("config", [dict(dim=64, heads=4), dict(dim=32, heads=2, depth=3, memory_depth=1,
                                                                 n_persistent=8, window=16)])
def test_parameter_counts_are_matched(config):
    counts = {v: TitansLM(TitansConfig(variant=v, vocab_size=VOCAB, **config)).num_parameters() for v in VARIANTS}
    low, high = min(counts.values()), max(counts.values())
    assert high <= 1.15 * low, counts


def test_baseline_memories_are_configs_of_the_same_layer():
    gdn = tiny_model("gated_deltanet").backbone.blocks[0].mixer
    assert (gdn.depth, gdn.rule.momentum, gdn.rule.residual, gdn.rule.gradients) == (1, False, False, "token")
    # its own rule: the exact delta rule takes the squared loss whatever the config's memory says
    assert tiny_model("gated_deltanet", memory={"loss": "huber"}).backbone.blocks[0].mixer.rule.loss.name == "squared"
    x = tokens(2, 15)
    logits = [tiny_model("gated_deltanet", chunk_size=c)(x)[0] for c in (1, 4, 16)]
    assert max((other - logits[0]).abs().max().item() for other in logits[1:]) <= 1e-12  # the exact delta rule
    gated = tiny_model("lmm", surprise_gate=True).backbone.blocks[0].mixer
    assert gated.rule.surprise_gate and gated.surprise_weight is not None


ABLATION_SWITCHES = dict(memory_depth=1, memory_residual=True, momentum=False, memory_forgetting=False,
                         memory_gates="constant", memory_forgetting_channels=True)


@pytest.mark.parametrize("name", ["lmm", "mac", "mag", "mal"])
def test_ablation_switches_reach_every_titans_memory(name):
    """The config's switches build the memory the ablation names (the layer's own tests hold each to the
    token-by-token rule); the Gated DeltaNet baseline keeps its own data-dependent gates and forgetting."""
    model = tiny_model(name, **ABLATION_SWITCHES)
    memories = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    assert len(memories) == 2
    for memory in memories:
        rule = memory.rule
        assert (memory.depth, rule.residual, rule.momentum, rule.forgetting, rule.gates,
                rule.forgetting_channels) == (1, True, False, False, "constant", True)
        assert memory.to_gates is None
    gdn = tiny_model("gated_deltanet", **ABLATION_SWITCHES).backbone.blocks[0].mixer
    assert (gdn.rule.forgetting, gdn.rule.gates, gdn.rule.forgetting_channels) == (True, "data", False)
    stepped = tiny_model(name, memory_hidden_step=0.25)
    assert {m.rule.hidden_step for m in stepped.modules() if isinstance(m, NeuralMemory)} == {0.25}
    huber = tiny_model(name, memory={"loss": {"name": "huber", "delta": 0.2, "gated": True}})
    assert {m.rule.loss.delta for m in huber.modules() if isinstance(m, NeuralMemory)} == {0.2}


@pytest.mark.parametrize("name", ["lmm", "mac", "mag", "mal", "gated_deltanet"])
def test_a_memory_whose_initial_weights_are_not_learned(name):
    """memory_learned_init=False: the same model at init, but the outer loop's gradient never reaches W_0 while it
    reaches every other parameter of the memory, and the trainer leaves W_0 out of its optimiser."""
    frozen, learned = tiny_model(name, memory_learned_init=False), tiny_model(name)
    x = tokens(2, 13)
    assert torch.equal(frozen(x)[0], learned(x)[0])
    frozen(x)[0].square().mean().backward()
    memories = [m for m in frozen.modules() if isinstance(m, NeuralMemory)]
    assert memories and all(not m.initial_weights[0].requires_grad for m in memories)
    for memory in memories:
        assert all(p.grad is None for p in memory.initial_weights)  # learned: every W_0 trains (below)
        assert memory.to_qkv.weight.grad is not None and memory.to_qkv.weight.grad.abs().sum() > 0
    optimised = {id(p) for group in make_optimizer(frozen, OptimConfig()).param_groups for p in group["params"]}
    assert not any(id(p) in optimised for m in memories for p in m.initial_weights)
    assert all(p.requires_grad for m in learned.modules() if isinstance(m, NeuralMemory) for p in m.initial_weights)


def test_the_memory_is_the_papers_mlp_by_default():
    """M(k) = W_2 σ(k W_1), no residual k + (DESIGN.md §1), in the config and in the layer alike."""
    assert TitansConfig().memory.residual is False and NeuralMemory(16).rule.residual is False
    assert {m.rule.residual for m in tiny_model("lmm").modules() if isinstance(m, NeuralMemory)} == {False}


OURS = sorted(set(UNREAD_FIELDS) & set(VARIANTS))  # the peer's: tests/models/test_peer.py


@pytest.mark.parametrize("variant, options", [*((v, {}) for v in OURS),
                                              ("mac", {"memory_gates": "constant", "memory_init_eta": 0.9})],
                         ids=[*OURS, "mac, constant gates"])
def test_a_field_a_model_does_not_read_changes_nothing(variant, options):
    """`unread_fields`, which lets the experiment runner read one model's runs back across them, is true: flipping
    such a field builds the same weights and the same outputs."""
    x = tokens(2, 13)
    other = {"memory.max_momentum_step": 0.05, "titans_pytorch": {"num_residual_streams": 1}}  # a value that binds
    for field in unread_fields(TitansConfig(variant=variant, **TINY, **options)):
        value = other.get(field, not model_field(TitansConfig(**TINY).to_dict(), field))
        section, _, name = field.rpartition(".")
        flipped = tiny_model(variant, **options, **({section: {name: value}} if section else {name: value}))
        same = tiny_model(variant, **options)
        assert flipped.state_dict().keys() == same.state_dict().keys()
        assert all(torch.equal(v, same.state_dict()[k]) for k, v in flipped.state_dict().items())
        assert torch.equal(flipped(x)[0], same(x)[0])


def test_a_saved_model_from_before_a_default_changed_loads_as_it_was_trained(tmp_path):
    """A config.json written before `memory_residual` and `memory_max_momentum_step` existed lacks them: its model
    had the residual and the free gates (the defaults then), so it loads with them, not with today's defaults
    (EARLIER_DEFAULTS). Such a file is format version 1, its memory's fields flat; a version-2 file holds every field
    in the memory section, and nothing earlier is filled into it."""
    model = tiny_model("lmm", memory_residual=True, memory_max_momentum_step=None)
    model.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    data = json.loads(path.read_text())
    assert data["titans_format_version"] == FORMAT_VERSION and data["titans"]["memory"]["residual"] is True
    memory = data["titans"].pop("memory")  # written as version 1 would have: flat, without the two fields
    flat = {old: memory[new] for old, new in FLAT_MEMORY_FIELDS.items() if old not in
            ("memory_residual", "memory_max_momentum_step")}
    path.write_text(json.dumps({**data, "titans_format_version": 1, "titans": {**data["titans"], **flat}}))
    again = TitansLM.from_pretrained(tmp_path / "m")
    x = tokens(1, 12)
    assert again.config.memory.residual is True and again.config.memory.max_momentum_step is None
    assert again.config == model.config and torch.equal(again(x)[0], model(x)[0])
    current = tiny_model("lmm")  # version 2, today's defaults (no residual, κ = 1): read as written
    current.save_pretrained(tmp_path / "v2")
    assert TitansLM.from_pretrained(tmp_path / "v2").config == current.config


def test_a_saved_mac_from_before_the_switches_loads_in_the_papers_order(tmp_path):
    """A config.json written before MAC's switches existed (format version 2) lacks them: its MAC was the paper's
    order, so it loads with every switch off (EARLIER_DEFAULTS), not with today's all-on default, and gives the
    outputs it was saved with. A file that holds the switches is read as written."""
    model = tiny_model("mac", **MAC_PAPER_ORDER)
    model.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    data = json.loads(path.read_text())
    section = {key: value for key, value in data["titans"].items() if key not in MAC_SWITCHES | {"titans_pytorch"}}
    attention = section.pop("attention")  # version 2 wrote the attention's fields flat
    section.update({flat: attention[name] for flat, name in FLAT_ATTENTION_FIELDS.items()})
    path.write_text(json.dumps({**data, "titans_format_version": 2, "titans": section}))
    again = TitansLM.from_pretrained(tmp_path / "m")
    x = tokens(1, 15)
    assert again.config == model.config and torch.equal(again(x)[0], model(x)[0])
    current = tiny_model("mac")  # written today: every switch on, read as written
    current.save_pretrained(tmp_path / "now")
    assert all(getattr(TitansLM.from_pretrained(tmp_path / "now").config, name) for name in MAC_SWITCHES)


def test_save_and_load_pretrained(tmp_path):
    model = tiny_model("mac").float()
    model.save_pretrained(tmp_path / "m")
    again = TitansLM.from_pretrained(tmp_path / "m")
    x = tokens(1, 12)
    assert again.config == model.config and not again.training  # loaded for inference
    assert torch.equal(again(x)[0], model(x)[0])
    tiny_model("mag").save_pretrained(tmp_path / "f64")  # float64 comes back float64, exactly
    again = TitansLM.from_pretrained(tmp_path / "f64")
    assert again.embed.weight.dtype == DT and torch.equal(again(x)[0], tiny_model("mag")(x)[0])
    other = tmp_path / "other"
    TitansLM(TitansConfig(variant="mac", **{**TINY, "dim": 32})).save_pretrained(other)
    (tmp_path / "m" / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="does not match"):
        TitansLM.from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="missing"):
        TitansLM.from_pretrained(tmp_path / "nowhere")
    config = tmp_path / "m" / "config.json"
    config.write_text(config.read_text().replace('"dim": 16', '"dim": 16, "dim": 32'))
    with pytest.raises(ValueError, match=r"config.json is not valid JSON: duplicate key\(s\) \['dim'\]"):
        TitansLM.from_pretrained(tmp_path / "m")


def test_an_lstm_whose_weights_share_one_buffer_saves_and_loads(tmp_path):
    """On CUDA cuDNN packs the LSTM's weights into one buffer (each parameter a view of part of it), which
    safetensors refuses to save: made here on the CPU the same way, the model saves, loads and computes as before."""
    model = tiny_model("lstm")
    for block in model.backbone.blocks:
        lstm = block.mixer.lstm
        flat = torch.cat([p.detach().reshape(-1) for p in lstm._flat_weights])
        at = 0
        for name, p in zip(lstm._flat_weights_names, lstm._flat_weights):
            setattr(lstm, name, nn.Parameter(flat[at:at + p.numel()].view_as(p)))
            at += p.numel()
        lstm._init_flat_weights()
    shared = model.backbone.blocks[0].mixer.lstm.weight_ih_l0
    assert shared.untyped_storage().nbytes() > shared.numel() * shared.element_size()  # as cuDNN leaves them
    model.save_pretrained(tmp_path / "m")
    again = TitansLM.from_pretrained(tmp_path / "m")
    x = tokens(1, 12)
    assert torch.equal(again(x)[0], model(x)[0])
    assert model.state_dict()["backbone.blocks.0.mixer.lstm.weight_ih_l0"].data_ptr() != shared.data_ptr()
    plain = tiny_model("lstm")  # weights of their own: the state dict copies nothing
    weight = plain.backbone.blocks[0].mixer.lstm.weight_ih_l0
    assert plain.state_dict()["backbone.blocks.0.mixer.lstm.weight_ih_l0"].data_ptr() == weight.data_ptr()


def test_save_pretrained_overwrites_nothing_unless_asked(tmp_path):
    first, second = tiny_model("lmm").float(), tiny_model("mag").float()
    first.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "notes.txt").write_text("mine")
    saved = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    with pytest.raises(ValueError, match="already holds a saved model; pass overwrite=True"):
        second.save_pretrained(tmp_path / "m")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == saved  # untouched
    second.save_pretrained(tmp_path / "m", overwrite=True)
    assert TitansLM.from_pretrained(tmp_path / "m").config == second.config
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        first.save_pretrained(tmp_path / "file")


def test_a_failed_save_leaves_the_previous_model_whole(tmp_path, monkeypatch):
    model = tiny_model("lmm").float()
    model.save_pretrained(tmp_path / "m")
    saved = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("titans.models.lm.save_model", fail)
    with pytest.raises(OSError, match="disk full"):
        tiny_model("mag").save_pretrained(tmp_path / "m", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == saved  # no partial files either


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"variant": "rnn"}, "variant"),
        ({"window": 0}, "window"),
        ({"dim": 30, "heads": 4}, "dim"),
        ({"segment_len": 0}, "segment_len"),
        ({"chunk_size": 0}, r"memory\.chunk_size"),
        ({"max_lr": -1.0}, r"memory\.max_lr"),
        ({"dropout": 1.5}, "dropout"),
        ({"n_persistent": -1}, "n_persistent"),
        ({"memory_heads": 3}, r"memory\.heads \(3\) must divide dim"),  # a flat name reads into the section
        ({"memory_activation": "relu"}, r"memory\.activation"),
        ({"memory_init_alpha": 1.0}, r"memory\.init_alpha"),
        ({"memory_max_grad_norm": -1.0}, r"memory\.max_grad_norm"),
        ({"memory_gates": "learned"}, r"memory\.gates"),
        ({"memory": {"hidden_step": 1.5}}, r"memory\.hidden_step"),
        ({"memory_gates": "constant", "surprise_gate": True}, "gates='constant'"),
        ({"memory": {"loss": "quartic"}}, "memory.loss"),
        ({"memory": {"loss": {"name": "lp", "p": 1.0}}}, r"memory\.loss\.p: must be > 1"),
        ({"memory": {"depth": 2, "gradients": "token", "momentum": False, "max_grad_norm": None,
                     "max_state_norm": None, "normalize_chunk": False}}, "needs depth=1"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TitansConfig(**{"variant": "mac", **overrides})
    with pytest.raises(ValueError, match=field):
        TitansConfig.from_dict({"variant": "mac", **overrides})


def test_bad_inputs():
    model = tiny_model("lmm")
    with pytest.raises(ValueError, match="tokens"):
        model(torch.full((1, 3), VOCAB))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="state"):
        model(tokens(1, 3), [None])  # one entry for a two-block model


def test_sampling_options():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).expand(400, -1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=g).tolist()) == {1, 2}
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=g).tolist()) == {1, 2}  # p(1) ≈ 0.47 < 0.5
    assert set(sample_next(logits, 1.0, top_p=0.3, generator=g).tolist()) == {1}
    assert torch.equal(sample_next(logits, 0.0), torch.ones(400, dtype=torch.long))
    assert len(set(sample_next(logits, 5.0, generator=g).tolist())) == 5  # flat enough: every token
    model = tiny_model("swa")
    prompt = tokens(2, 3)
    a = model.generate(prompt, 10, temperature=0.8, top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 10, temperature=0.8, top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, 2, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1.0)
    # checked even where unused: greedy decoding, no new tokens; NaN is not a temperature
    for bad, name in ((dict(temperature=0.0, top_k=0), "top_k"), (dict(temperature=0.0, top_p=2.0), "top_p"),
                      (dict(temperature=float("nan")), "temperature")):
        for new_tokens in (0, 3):
            with pytest.raises(ValueError, match=name):
                model.generate(prompt, new_tokens, **bad)


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    g = torch.Generator().manual_seed(0)
    for probs, top_p, kept in (([0.5, 0.25, 0.25], 0.5, {0}), ([0.5, 0.25, 0.125, 0.125], 0.75, {0, 1}),
                               ([0.25] * 4, 0.5, {0, 1}), ([0.5, 0.25, 0.25], 1e-9, {0})):
        logits = torch.tensor(probs).log().expand(2000, -1)
        drawn = set(sample_next(logits, 1.0, top_p=top_p, generator=g).tolist())
        if len(set(probs)) == 1:  # ties: which tokens survive is arbitrary, how many is not
            assert len(drawn) == len(kept)
        else:
            assert drawn == kept, (probs, top_p)


# MAC's switches (TitansConfig.mac_*), each alone on the paper's order (all off) and all together (the default since
# issue 47): the ways titans-pytorch's MAC differs from the paper's order
MAC_SWITCHED = {**{name: {**MAC_PAPER_ORDER, name: True} for name in sorted(MAC_SWITCHES)}, "all": {}}


@pytest.fixture(scope="module", params=sorted(MAC_SWITCHED))
def switched_mac(request):
    return tiny_model("mac", **MAC_SWITCHED[request.param])


def test_a_mac_switch_changes_the_model_and_keeps_it_causal(switched_mac):
    x = tokens(2, 20)
    assert (switched_mac(x)[0] - tiny_model("mac", **MAC_PAPER_ORDER)(x)[0]).abs().max() > 1e-6
    assert_causal(switched_mac)


@pytest.mark.parametrize("cuts", [[1, 4, 7, 13, 18], [3, 9, 10, 11, 17]])
def test_a_switched_mac_streams_in_pieces_as_one_call(switched_mac, cuts):
    assert_pieces_equal_one_call(switched_mac, cuts)


def test_mac_switches_all_on_by_default_and_all_off_the_model_from_before_them():
    """Every switch on by default (issue 47's measurement); every switch off: the same parameters (names and shapes) as
    MAC before the switches existed, and the paper-order MAC (next test) exactly, not just to rounding."""
    assert all(getattr(TitansConfig(variant="mac"), name) for name in MAC_SWITCHES)
    model = tiny_model("mac", **MAC_PAPER_ORDER)
    names = {name.split("mixer.", 1)[1] for name in model.state_dict() if ".mixer." in name}
    assert {name for name in names if "context_norm" in name} == set()
    assert {name for name in names if name.startswith("memory_norm")} == {"memory_norm.weight"}


@pytest.mark.parametrize("switches", ["off", *sorted(MAC_SWITCHED)])
def test_mac_follows_the_paper_order(switches):
    """MAC written out segment by segment: retrieve from the memory as it stood before the segment,
    attend over [p ‖ h ‖ x], write the attention output into the memory, gate with the updated memory. With a switch,
    its departure written out beside it (models/mac.py): x written instead of y, h added to the attended stream and
    the output, the context read through its own norm (position-free persistent keys: the next test)."""
    options = MAC_SWITCHED.get(switches, MAC_PAPER_ORDER)
    mixer = tiny_model("mac", **options).backbone.blocks[0].mixer
    config = TitansConfig(variant="mac", **options)
    write_input, residual_read = config.mac_write_input, config.mac_residual_read
    x = torch.randn(2, 14, 16, dtype=DT, generator=torch.Generator().manual_seed(6))  # segments 6, 6, 2
    memory, query_cache, outputs = None, None, []
    for start in range(0, 14, 6):
        segment = x[:, start : start + 6]
        h, query_cache = mixer.memory.retrieve(segment, memory, query_cache,  # memory before the segment
                                               norm_weight=mixer.context_norm)
        y, _ = mixer.attention(segment + h if residual_read else segment, h, mixer.persistent.tokens)
        written = segment if write_input else mixer.memory_norm(y)
        gate, memory = mixer.memory(written, memory)  # then the update, then the gate
        outputs.append(y * torch.sigmoid(gate) + (h if residual_read else 0))
    out, _ = mixer(x)
    if switches == "off":
        assert torch.equal(out, torch.cat(outputs, 1))
    assert (out - torch.cat(outputs, 1)).abs().max() <= 1e-12
    if config.mac_separate_norms:  # the context read's norm is its own: the gate's read keeps the memory's
        assert mixer.context_norm is not mixer.memory.out_norm_weight and mixer.context_norm.shape == \
            mixer.memory.out_norm_weight.shape


def test_mac_position_free_persistent_keys_score_without_the_querys_rotation():
    """mac_position_free_persistent: query i scores persistent key p as q_i · k_p (no rotation on either side, as
    the window attention scores its prefix), and h_j, x_j as (R_i q_i) · (R_j k_j); written out with an explicit
    softmax, query by query."""
    from titans.layers import SegmentAttention

    torch.manual_seed(0)
    attention = SegmentAttention(16, 2, 6, position_free_persistent=True).to(DT)
    g = torch.Generator().manual_seed(9)
    x, h, p = torch.randn(2, 6, 16, generator=g, dtype=DT), torch.randn(2, 6, 16, generator=g, dtype=DT), \
        torch.randn(3, 16, generator=g, dtype=DT)
    y, _ = attention(x, h, p)
    positions = torch.arange(6)
    q_plain, k_x, v_x = attention.project(x, None)
    q, k_x = attention.rope(q_plain, positions), attention.rope(k_x, positions)
    k_h, v_h = attention.project_keys(h, positions)
    k_p, v_p = (t.expand(2, -1, -1, -1) for t in attention.project_keys(p[None], None))
    rows = []
    for i in range(6):
        scores = torch.cat([q_plain[:, :, i : i + 1] @ k_p.transpose(-1, -2),
                            q[:, :, i : i + 1] @ k_h[:, :, : i + 1].transpose(-1, -2),
                            q[:, :, i : i + 1] @ k_x[:, :, : i + 1].transpose(-1, -2)], -1) / 8**0.5
        values = torch.cat([v_p, v_h[:, :, : i + 1], v_x[:, :, : i + 1]], 2)
        rows.append(scores.softmax(-1) @ values)
    assert (y - attention.merge(torch.cat(rows, 2))).abs().max() <= 1e-12
    rotated = SegmentAttention(16, 2, 6).to(DT)
    rotated.load_state_dict(attention.state_dict())
    assert (rotated(x, h, p)[0] - y).abs().max() > 1e-6  # today's: the rotated query scores p


def test_mag_follows_the_paper():
    """Eqs. 26-28: x̃ = [p ‖ x], y = SW-Attn*(x̃) with the prefix always visible, o = norm(y) ⊙ σ(norm(M(x̃)))."""
    mixer = tiny_model("mag").backbone.blocks[0].mixer
    x = torch.randn(2, 14, 16, dtype=DT, generator=torch.Generator().manual_seed(7))  # 16 > prefix 2 + window 5
    x_tilde = mixer.persistent.prepend(x)
    y = reference_window_attention(mixer.attention, x_tilde, 2)
    m, _ = mixer.memory(x_tilde)
    expected = (mixer.norm_attention(y) * torch.sigmoid(mixer.norm_memory(m)))[:, 2:]
    assert (mixer(x)[0] - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("residual", [True, False])
def test_mal_follows_the_paper(residual):
    """Eqs. 29-31: x̃ = [p ‖ x], y = M(x̃), then sliding-window attention with the prefix always visible: over
    norm(y) as eq. 31 writes it, or (mal_residual, the default) y + SW-Attn(norm(x̃ + y)), each layer residual."""
    mixer = tiny_model("mal", mal_residual=residual).backbone.blocks[0].mixer
    x = torch.randn(2, 14, 16, dtype=DT, generator=torch.Generator().manual_seed(8))
    x_tilde = mixer.persistent.prepend(x)
    y, _ = mixer.memory(x_tilde)
    if residual:
        expected = (y + reference_window_attention(mixer.attention, mixer.norm(x_tilde + y), 2))[:, 2:]
    else:
        expected = reference_window_attention(mixer.attention, mixer.norm(y), 2)[:, 2:]
    assert (mixer(x)[0] - expected).abs().max() <= 1e-12


def test_bf16_autocast_trains_and_stays_causal(variant):
    """Mixed precision: autocast runs the projections and attention in bf16 while the memory keeps its
    float32 state (autocast is off inside the update rule and its backward pass)."""
    model = tiny_model(variant).float().train()
    x = tokens(2, 20)
    norm_outputs = []  # every norm normalises in its weight's dtype (float32), whatever autocast hands it
    for norm in (m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)):
        norm.register_forward_hook(lambda mod, args, out: norm_outputs.append((out.dtype, mod.weight.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, state = model(x)
        logits.float().logsumexp(-1).mean().backward()
        changed = x.clone()
        changed[:, 11] = (changed[:, 11] + 5) % VOCAB
        logits2, _ = model(changed)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert sum(p.grad is not None for p in model.parameters()) == len(list(model.parameters()))
    assert torch.equal(logits2[:, :11], logits[:, :11])
    assert norm_outputs and all(got == own for got, own in norm_outputs), set(norm_outputs)
    if variant in ("lmm", "mac", "mag", "mal", "gated_deltanet"):
        tensors = {}
        _flatten(state, "state", tensors)
        weights = {k: t for k, t in tensors.items() if "weights" in k or "momentum" in k}
        assert weights and all(t.dtype == torch.float32 for t in weights.values()), weights.keys()


def test_empty_pieces_change_nothing(model):
    """A zero-length piece (first, or mid-stream inside a memory chunk) returns empty logits and a state that
    continues exactly like the one it was given."""
    x = tokens(2, 20, seed=3)
    logits, _ = model(x)
    empty, state = model(x[:, :0])
    assert empty.shape == (2, 0, VOCAB)
    first, state = model(x[:, :6], state)
    nothing, state = model(x[:, 6:6], state)
    rest, _ = model(x[:, 6:], state)
    assert nothing.shape == (2, 0, VOCAB)
    assert (torch.cat([first, rest], 1) - logits).abs().max() <= 1e-12

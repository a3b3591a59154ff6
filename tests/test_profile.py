"""What enters from outside is checked against the model: calibration profiles (a JSON file or
``profile=``), a model directory's weights, the device to load on. Tiny random Llama models, no
downloads."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tierkv import TierConfig, TieredCache
from tierkv.cli import EXIT_ERROR, main
from tierkv.hf.model import ModelLoadError, load_model
from tierkv.hf.profile import PROFILES, check_profile, load_profile
from tierkv.hf.model import cache_kwargs

SHIPPED = json.loads((PROFILES / "smollm2-135m.json").read_text())


def _config(layers: int = 4, kv_heads: int = 1, name: str = "tiny") -> LlamaConfig:
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=kv_heads)
    config._name_or_path = name
    return config


def _model(layers: int = 4, kv_heads: int = 1, name: str = "tiny") -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_config(layers, kv_heads, name)).eval()


def test_the_shipped_profile_fits_smollm2_shapes():
    check_profile(SHIPPED, 30, 3, "shipped")
    check_profile({}, 30, 3)
    check_profile({"filter_layers": (0, 5), "retrieval_heads": {14: [2, 0], "3": []}}, 30, 3)


@pytest.mark.parametrize("profile, match", [
    ("abc", r"profile=: expected a dict \(a JSON object\) .*got str 'abc'"),
    ([1, 2], "profile=: expected a dict .*got list"),
    ({"filter_layers": "2,8"}, r"filter_layers='2,8': must be strictly increasing layer indices in \[0, 29\)"),
    ({"filter_layers": [12, 2, 17]}, r"profile=: filter_layers=\[12, 2, 17\]: must be strictly increasing"),
    ({"filter_layers": [2, 2, 17]}, r"filter_layers=\[2, 2, 17\]: must be strictly increasing"),
    ({"filter_layers": [-3, 2, 17]}, r"filter_layers=\[-3, 2, 17\]: must be"),
    ({"filter_layers": [2.5, 17]}, r"filter_layers=\[2.5, 17\]: must be"),
    ({"filter_layers": [True, 17]}, r"filter_layers=\[True, 17\]: must be"),
    ({"filter_layers": []}, r"filter_layers=\[\]: must be"),
    ({"filter_layers": None}, r"filter_layers=None: must be"),
    ({"filter_layers": [2, 29]}, r"filter_layers=\[2, 29\]: .* \[0, 29\): the profile does not fit "
                                 r"this model of 30 layers and 3 KV heads .*tierkv calibrate --model DIR"),
    ({"retrieval_heads": [[14, 1]]}, r"retrieval_heads=\[\[14, 1\]\]: expected a dict \{layer: "
                                     r"\[KV heads\]\}, got list"),
    ({"retrieval_heads": {"x": [1]}}, r"retrieval_heads\['x'\]: the key must be a layer index"),
    ({"retrieval_heads": {"-1": [1]}}, r"retrieval_heads\['-1'\]: the key must be a layer index"),
    ({"retrieval_heads": {"14": [1], 14: [2]}}, r"retrieval_heads\[14\]: layer 14 is given twice"),
    ({"retrieval_heads": {"99": [1]}}, r"retrieval_heads\['99'\]: layer out of range \[0, 30\): "
                                       r"the profile does not fit this model"),
    ({"retrieval_heads": {"14": 1}}, r"retrieval_heads\['14'\]=1: expected a list of KV head indices"),
    ({"retrieval_heads": {"14": [-1]}}, r"retrieval_heads\['14'\]=\[-1\]: expected a list of KV head"),
    ({"retrieval_heads": {"14": [1.0]}}, r"retrieval_heads\['14'\]=\[1.0\]: expected a list of KV"),
    ({"retrieval_heads": {"14": [1, 1]}}, r"retrieval_heads\['14'\]=\[1, 1\]: KV heads must be distinct"),
    ({"retrieval_heads": {"14": [7]}}, r"retrieval_heads\['14'\]=\[7\]: KV head out of range \[0, 3\): "
                                       r"the profile does not fit this model"),
])
def test_bad_profiles_are_named(profile, match):
    with pytest.raises(ValueError, match=match):
        check_profile(profile, 30, 3)


def test_a_profile_file_is_checked_against_the_model(tmp_path):
    model = SimpleNamespace(config=_config(layers=4, kv_heads=1, name="/models/tiny"))
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"filter_layers": [2], "retrieval_heads": {"3": [0]}}))
    assert load_profile(model, tmp_path)["filter_layers"] == [2]
    path.write_text(json.dumps(SHIPPED))
    with pytest.raises(ValueError, match=rf"profile {tmp_path / 'tiny.json'}: filter_layers=\[2, 12, 17\]: "
                                         r".*\[0, 3\): the profile does not fit this model of 4 "
                                         r"layers and 1 KV head .*`tierkv calibrate --model /models/tiny`"):
        load_profile(model, tmp_path)
    path.write_text(json.dumps({"retrieval_heads": {"1": "0"}}))
    with pytest.raises(ValueError, match=rf"profile {tmp_path / 'tiny.json'}: retrieval_heads\['1'\]='0'"):
        load_profile(model, tmp_path)


def test_a_profile_of_another_model_with_the_same_id_is_refused(tmp_path):
    """A model directory named like a shipped model gets the shipped profile, made for another
    shape: the cache says so before storing anything."""
    model = _model(layers=4, kv_heads=1, name=str(tmp_path / "smollm2-135m"))
    config = TierConfig(device_budget="1MB", host_budget="1MB", disk_dir=tmp_path / "kv")
    for policy in ("full", "razor", "tierkv"):
        with pytest.raises(ValueError, match=r"profiles/smollm2-135m.json: filter_layers=\[2, 12, 17\].* "
                                             r"does not fit this model of 4 layers and 1 KV head .*"
                                             rf"tierkv calibrate --model {tmp_path / 'smollm2-135m'}"):
            TieredCache(model, config, policy)
    assert getattr(model, "_tierkv_cache", lambda: None)() is None  # nothing installed


def test_the_profile_argument_is_checked(tmp_path):
    model = _model(layers=4, kv_heads=1)
    config = TierConfig(device_budget="1MB", host_budget="1MB", disk_dir=tmp_path)
    with pytest.raises(ValueError, match=r"profile=: retrieval_heads\['3'\]=\[1\]: KV head out of "
                                         r"range \[0, 1\)"):
        TieredCache(model, config, "razor", profile={"retrieval_heads": {"3": [1]}})
    with pytest.raises(ValueError, match=r"profile=: filter_layers=\[3, 1\]: must be strictly increasing "
                                         r"layer indices in \[0, 3\)"):
        TieredCache(model, config, profile={"filter_layers": [3, 1]})
    with pytest.raises(ValueError, match="profile=: expected a dict"):
        TieredCache(model, config, profile="smollm2-135m.json")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with TieredCache(model, config, "razor", profile={"retrieval_heads": {"3": [0]}}) as cache, \
            torch.no_grad():
        model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Path:
    """A model directory whose model.safetensors lost its end."""
    path = tmp_path_factory.mktemp("models") / "damaged"
    _model().save_pretrained(path, safe_serialization=True)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def test_damaged_weights_name_the_file(damaged):
    with pytest.raises(ModelLoadError, match=rf"model '{damaged}': {damaged / 'model.safetensors'}: "
                                             r"damaged or truncated weights \(.+\)"):
        load_model(damaged)


def test_the_cli_reports_damaged_weights_in_one_line(damaged, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    assert main(["generate", "--file", str(doc), "--question", "q", "--model", str(damaged)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "tierkv: error: model" in err and "model.safetensors: damaged or truncated" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("device, match", [
    ("tpu", "device='tpu': must be 'cpu', 'cuda' or 'cuda:N'"),
    ("cuda:x", "device='cuda:x': must be"),
    (0, "device=0: must be"),
    ("cuda" if not torch.cuda.is_available() else "cuda:99",
     "CUDA is not available on this machine" if not torch.cuda.is_available() else "CUDA device"),
])
def test_the_device_is_checked_before_loading(device, match, damaged):
    with pytest.raises(ValueError, match=match):  # before the damaged weights are read
        load_model(damaged, device=device)

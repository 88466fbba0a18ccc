"""The reference server's method names: the block drafters (jetspec, dspark) and domino parse
with their defaults and are refused at launch naming the method and the methods that are available."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trtedge import ConfigError
from trtedge.config import LaunchConfig
from trtedge.runtime.speculative import (
    AVAILABLE_METHODS,
    SpeculativeConfig,
    UnsupportedSpeculativeMethod,
    check_supported,
)


@pytest.mark.parametrize("method,depth", [("jetspec", 16), ("dspark", 7)])
def test_block_drafters_parse_and_are_refused_listing_the_available_methods(method, depth):
    spec = SpeculativeConfig.coerce({"method": method, "model": "draft"})
    assert spec.num_speculative_tokens == depth and spec.needs_model
    with pytest.raises(
        UnsupportedSpeculativeMethod, match=f"method {method} is not available in trtedge yet"
    ):
        check_supported(spec)
    with pytest.raises(ConfigError, match="available: " + ", ".join(AVAILABLE_METHODS) + "$"):
        LaunchConfig(model="m", speculative={"method": method, "model": "draft"})
    with pytest.raises(ConfigError, match=f"method {method} needs model"):
        LaunchConfig(model="m", speculative={"method": method})


def test_dflash_parses_with_the_references_default_depth():
    spec = SpeculativeConfig.coerce({"method": "dflash", "model": "draft"})
    assert spec.num_speculative_tokens == 15 and spec.needs_model  # one block of 16


def test_dflash_is_refused_for_hybrid_models():
    spec = SpeculativeConfig(method="dflash", model="draft")
    with pytest.raises(
        UnsupportedSpeculativeMethod, match="method dflash is not supported with hybrid models"
    ):
        check_supported(spec, "qwen3_5", hybrid=True)


def test_available_methods_pass_the_launch_check():
    for spec in (
        {"method": "ngram"},
        {"method": "mtp"},
        {"method": "draft_model", "model": "d"},
        {"method": "dflash", "model": "d"},
    ):
        assert LaunchConfig(model="m", speculative=spec).speculative.method == spec["method"]


def test_domino_parses_with_or_without_a_model_and_is_refused():
    for value in ({"method": "domino"}, {"method": "domino", "model": "draft"}):
        with pytest.raises(ConfigError, match="method domino is not available in trtedge yet; available: "):
            LaunchConfig(model="m", speculative=value)


class _Runner:
    """What build_decoder reads of a runner: a hybrid model (a state pool) with decode graphs that take
    verify chains ("chains"), graphs that do not (tensor parallelism: "plain"), or none."""

    def __init__(self, graphs: str):
        self.model = SimpleNamespace(cfg=SimpleNamespace(model_type="qwen3_5"), aux_layers=())
        self.states = object()
        self.graphs = (
            None if graphs == "none" else SimpleNamespace(aux_layers=(), verify_chains=graphs == "chains")
        )
        self.tp = None if graphs != "plain" else object()


@pytest.mark.parametrize("graphs", ["chains", "plain", "none"])
def test_a_hybrid_target_verifies_in_its_graphs_and_warns_where_it_cannot(graphs, caplog):
    from trtedge.runtime.speculative import build_decoder

    with caplog.at_level("WARNING", logger="trtedge"):
        decoder = build_decoder(SpeculativeConfig(method="ngram"), None, _Runner(graphs), None, 64, 256)
    assert decoder.config.method == "ngram" and decoder.graph_verify == (graphs == "chains")
    warned = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    if graphs == "plain":
        assert len(warned) == 1 and "ngram" in warned[0] and "qwen3_5" in warned[0]
        assert "tensor parallelism" in warned[0] and "disable_spec_decode" in warned[0]
    else:  # graphs that take the chains; or the CPU (graphs off): every step runs eagerly, plain ones too
        assert warned == []

"""The request pipeline every API shares: a runtime error names its field as data, never read from its
wording (test_api.py has the HTTP cases)."""

from __future__ import annotations

import pytest

from trtedge.runtime.sampling_params import ParamError, SamplingParams
from trtedge.server.core import value_error


def test_sampling_checks_name_their_field_as_data():
    for kwargs, param in [
        ({"top_p": 2.0}, "top_p"),
        ({"logit_bias": {5: 500}}, "logit_bias"),
        ({"stop": ("",)}, "stop"),
        ({"guided_decoding": {"regex": ""}}, "guided_decoding.regex"),
    ]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param, (kwargs, e.value)


def test_the_field_comes_from_the_error_not_its_wording():
    assert value_error(ParamError("top_p", "bad"), "messages").param == "top_p"
    # a plain ValueError that happens to start with a field's name names the default field
    assert value_error(ValueError("temperature went wrong"), "messages").param == "messages"
    # a field the HTTP request does not have (the runtime's own name) is not shown as one
    assert value_error(ParamError("guided_decoding.regex", "bad"), "prompt").param == "prompt"


def test_a_param_error_crosses_the_engine_core_process_with_its_field():
    from trtedge.runtime.client import _error, _kind

    error = _error(_kind(ParamError("cache_generated_tokens", "no")), "no")
    assert isinstance(error, ParamError) and error.param == "cache_generated_tokens" and str(error) == "no"
    assert type(_error(_kind(ValueError("plain")), "plain")) is ValueError

"""Every batch number a ds_config fix suggests, pasted into the config, passes DeepSpeed 0.19.8's own batch check
(DeepSpeedConfig._initialize_params + _configure_train_batch_size at the data-parallel size) (issue 30)."""
from __future__ import annotations

import copy
import itertools
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest

from preflight.checks.ds_config.batch import check_batch
from preflight.checks.ds_config.findings import Report
from preflight.hostside import hfauto
from preflight.hostside.outcome import Status

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# "KEY = N" or "KEY = a x b x c = N": the number a user would paste for KEY.
SUGGESTION = re.compile(r"\b(" + "|".join(KEYS) + r") = (?:[\d.]+ x [\d.]+ x [\d.]+ = )?(\d+)\b")


def deepspeed_batch_ok(config: Dict[str, Any], world_size: int) -> Optional[str]:
    """None when DeepSpeed's own DeepSpeedConfig accepts the batch keys at this data-parallel size, else its error.
    The body of DeepSpeedConfig.__init__ after the world size is read (runtime/config.py:439-482), with the world
    size DeepSpeed would get from torch.distributed set directly."""
    runtime_config = pytest.importorskip("deepspeed.runtime.config")
    cfg = runtime_config.DeepSpeedConfig.__new__(runtime_config.DeepSpeedConfig)
    cfg.global_rank, cfg.world_size = 0, world_size
    cfg._param_dict = copy.deepcopy(config)
    try:
        cfg._initialize_params(copy.copy(cfg._param_dict))
        cfg._configure_train_batch_size()
    except (AssertionError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def suggestions(fix: str) -> List[Tuple[str, int]]:
    return [(k, int(v)) for k, v in SUGGESTION.findall(fix)]


def batch_findings(config: Dict[str, Any], dp: int, integration: str = "deepspeed"):
    report = Report()
    check_batch(config, dp, [], report, None, integration)
    return [f for f in report.star if f.status in (Status.FAIL, Status.WARN)]


GRID = list(itertools.product((None, 7, 60, 64, 66, 100), (None, 3, 4), (None, 2, 4), (3, 6, 8)))


@pytest.mark.parametrize("tb,mb,ga,dp", GRID)
def test_each_suggested_batch_number_passes_deepspeeds_check_when_pasted(tb, mb, ga, dp):
    config = {k: v for k, v in zip(KEYS, (tb, mb, ga)) if v is not None}
    if not config:
        return
    failing = deepspeed_batch_ok(config, dp)
    found = batch_findings(config, dp)
    assert (failing is None) == (not found), (config, dp, failing, [f.message for f in found])
    if failing is None:
        return
    (finding,) = found
    pasted = suggestions(finding.fix)
    assert pasted, finding.fix
    for key, value in pasted:
        fixed = dict(config, **{key: value})
        assert deepspeed_batch_ok(fixed, dp) is None, (config, dp, finding.fix, key, value,
                                                       deepspeed_batch_ok(fixed, dp))


def test_the_issues_example_no_longer_suggests_a_multiple_of_the_world_size():
    """train_batch_size 64 with micro batch 4 and accumulation 4 on 3 ranks: "a multiple of 3" (66) still fails
    DeepSpeed's 66 != 4 * 4 * 3; the only train_batch_size that works is 48."""
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    (finding,) = batch_findings(config, 3)
    assert "multiple of 3" not in finding.fix
    assert "66 != 4 * 4 * 3" in deepspeed_batch_ok(dict(config, train_batch_size=66), 3)
    assert ("train_batch_size", 48) in suggestions(finding.fix)
    assert all(deepspeed_batch_ok(dict(config, **{k: v}), 3) is None for k, v in suggestions(finding.fix))


@pytest.mark.parametrize("tb,mb,ga,dp", [(100, "auto", "auto", 8), (100, 4, "auto", 8), (90, "auto", 4, 6),
                                         (30, 4, "auto", 3)])
def test_an_auto_batch_fix_passes_once_the_hf_integration_fills_the_rest(tb, mb, ga, dp):
    """'set train_batch_size to "auto", or to N or M': each N pasted, the Trainer's fill of the other "auto" keys
    (hostside/hfauto.py) gives a config DeepSpeed accepts; and so does "auto" itself."""
    config = {k: v for k, v in zip(KEYS, (tb, mb, ga))}
    (finding,) = batch_findings(config, dp, "hf")
    numbers = [int(n) for n in re.search(r'or to ([\d ]+(?:or [\d ]+)*)\(', finding.fix).group(1).split(" or ")]
    assert numbers
    for value in numbers + ["auto"]:
        filled, _ = hfauto.fill(dict(config, train_batch_size=value), dp)
        assert deepspeed_batch_ok(filled, dp) is None, (config, value, filled)

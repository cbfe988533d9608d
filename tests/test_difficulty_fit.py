"""Fitting the built-in scorer: logistic regression and ROC AUC by hand, and ``kvpilot
difficulty fit`` turning a labelled file into a policy that Envoy accepts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from harness.builders import policy, pool, route

from bench.difficulty.prompts import PromptMix, generate, labelled_lines
from commands.cli import main
from compiler import compile_plan
from controlplane.local import find_binary
from policies import load_objects
from signals import PolicyState
from signals.difficulty import score
from signals.difficultyfit import LabelError, logistic_regression, read_rows, roc_auc
from xdsserver.static import validate_with_envoy
from xdsserver.translate import translate


def test_roc_auc_counts_pairs_and_ties() -> None:
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [False, False, True, True]) == 0.0
    assert roc_auc([0.5, 0.5], [False, True]) == 0.5
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75


def test_logistic_regression_recovers_a_planted_model() -> None:
    rng = random.Random(3)
    x = [[rng.gauss(0, 1), rng.gauss(0, 1)] for _ in range(4000)]
    y = [rng.random() < 1 / (1 + 2.718281828 ** -(-0.5 + 2 * a - 1 * b)) for a, b in x]
    beta = logistic_regression(x, y)
    assert beta == pytest.approx([-0.5, 2, -1], abs=0.15)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{", "line 1: not JSON"),
        ('{"prompt": "hi"}', "line 1: small_ok"),
        ('{"small_ok": "yes", "prompt": "hi"}', "line 1: small_ok"),
        ('{"small_ok": true}', "line 1: needs request"),
        ("[1]", "line 1: expected an object"),
    ],
)
def test_a_bad_labelled_row_is_named_by_line_and_field(line: str, words: str) -> None:
    with pytest.raises(LabelError, match=words):
        read_rows([line])


def virtual_policy_file(path: Path) -> Path:
    document = policy(
        "main",
        10000,
        [
            route("small", name="small", match={"models": ["llama-small"]}),
            route("large", name="large", match={"models": ["llama-large"]}),
        ],
    )
    document["spec"]["virtualModels"] = [
        {"name": "llama-auto", "small": "llama-small", "large": "llama-large"}
    ]
    docs = [
        pool("small", [8001], models=["llama-small"]),
        pool("large", [8002], models=["llama-large"]),
        document,
    ]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def test_fit_writes_weights_into_the_policy_and_envoy_accepts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = generate(2000, PromptMix(), seed=7)
    data = tmp_path / "labelled.jsonl"
    data.write_text("\n".join(labelled_lines(prompts)) + "\n")
    source = virtual_policy_file(tmp_path / "policy.yaml")
    out = tmp_path / "fitted.yaml"
    code = main(
        [
            "difficulty",
            "fit",
            str(data),
            "-f",
            str(source),
            "--virtual-model",
            "llama-auto",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    report = capsys.readouterr().err
    auc = float(report.rsplit(":", 1)[1])
    assert auc > 0.8, report

    objects = load_objects(out)
    fitted = next(o for o in objects if o.kind == "RoutingPolicy").spec.virtual_models[0]  # type: ignore[union-attr]
    weights = fitted.scorer.builtin.weights
    assert set(weights) == set(json.loads(json.dumps(weights)))
    # The fitted scorer ranks hard prompts of a fresh draw above easy ones.
    fresh = generate(400, PromptMix(), seed=8)
    scores = [score(weights, fitted.scorer.builtin.bias, p.encoded()) for p in fresh]
    assert roc_auc(scores, [not p.small_ok for p in fresh]) > 0.8

    plan = compile_plan(PolicyState.from_objects(objects))
    assert not [d for d in plan.diagnostics if d.severity == "error"], plan.diagnostics
    envoy = find_binary("envoy")
    for fleet in plan.fleets:
        ok, output = validate_with_envoy(translate(fleet), envoy, tmp_path / fleet.fleet)
        assert ok, output


def test_fit_names_a_missing_virtual_model_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "labelled.jsonl"
    data.write_text("\n".join(labelled_lines(generate(50, PromptMix(), seed=1))))
    source = virtual_policy_file(tmp_path / "policy.yaml")
    before = source.read_text()
    code = main(["difficulty", "fit", str(data), "-f", str(source), "--virtual-model", "nope"])
    assert code == 1
    assert "virtual model 'nope'" in capsys.readouterr().err
    assert source.read_text() == before

"""A planted secret reaches no sink's output, no span, no resource and no log line.

Three layers: the rules themselves (``is_secret_key``, ``scrub_value``) on examples; hypothesis
properties both ways (secrets planted anywhere in random configs never come out; ordinary keys and
values come out untouched); and real runs through every local backend, in this process and in a
training process of its own whose stdout and stderr (which its bridge process inherits) and log
records at DEBUG (both processes) are grepped with every file written and everything an OTLP
endpoint received (but the request header the secret was meant for)."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import secrets as random_secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_tracking import Tracking, ValidationGenerationsLogger, trace_state
from otel_tracking.signals.redact import REDACTED, is_secret_key, redact_config, scrub_text, scrub_value
from tests.otlp_receiver import HttpReceiver

REPO = Path(__file__).resolve().parent.parent
SECRET = "pl4nted-s3cret-0xDEADBEEF"
BACKENDS = ["file", "console", "tensorboard", "mlflow", "wandb", "swanlab", "clearml", "trackio"]
# Tokenizer settings every RL config has: not credentials, kept as they are.
TOKENIZER = {
    "pad_token": "<|endoftext|>",
    "eos_token": "</s>",
    "bos_token": "<s>",
    "unk_token": "<unk>",
    "sep_token": "[SEP]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
    "im_start_token": "<|im_start|>",
    "pad_token_id": 151643,
    "eos_token_id": 151645,
    "padToken": "<pad>",
}


# --- the rules, on examples -------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["hfToken", "wandbApiKey", "auth.token", "HF_TOKEN", "HFToken", "APIKey", "x-api-key", "secretAccessKey",
     "VOLC_ACCESS_KEY_ID", "db.password", "clientSecret", "AccountKey", "sshPassphrase", "session_token"],
)  # fmt: skip
def test_credential_keys_in_any_spelling_are_secret(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [*TOKENIZER, "bos_token_id", "decoder_start_token_id", "ppo_max_token_len_per_gpu", "max_new_tokens",
     "prompt_key", "reward_fn_key", "response_key", "tokenizer", "secretary_count", "task", "risk", "peak"],
)  # fmt: skip
def test_tokenizer_settings_and_training_knobs_are_not(key: str) -> None:
    assert not is_secret_key(key)


@pytest.mark.parametrize(
    ("text", "scrubbed"),
    [
        ("http://user:password@proxy:8080", "http://<redacted>@proxy:8080"),
        ("postgresql://u:pw@db/x", "postgresql://<redacted>@db/x"),
        ("https://ghp_abc@github.com/o/r.git", "https://<redacted>@github.com/o/r.git"),
        ("http://u:p@ss@host/path", "http://<redacted>@host/path"),  # an unencoded "@" in the password
        ("see sk-proj-" + "a1" * 12 + " here", "see <redacted> here"),
        ("hf_" + "Ab" * 17, REDACTED),
        ("ghp_" + "x" * 36, REDACTED),
        ("github_pat_" + "A" * 30, REDACTED),
        ("xoxb-1234-abcdefghij", REDACTED),
        ("AKIAIOSFODNN7EXAMPLE", REDACTED),
        ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln", REDACTED),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\nnext", f"{REDACTED}\nnext"),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl (cut)", REDACTED),
        ("https://hooks.slack.com/services/T0/B0/xyz", "https://hooks.slack.com/services/<redacted>"),
        ("Authorization: Bearer abcdefghijklmnop1234", "Authorization: Bearer <redacted>"),
        ("https://h/api?access_token=abc&page=2", "https://h/api?access_token=<redacted>&page=2"),
        ("host=db user=u password=pw", "host=db user=u password=<redacted>"),
        ("data.hf_token=abc", "data.hf_token=<redacted>"),
        ("--wandbApiKey=abc", "--wandbApiKey=<redacted>"),
        ("proxy=http://u:pw@h:1", "proxy=http://<redacted>@h:1"),
        # quoted pairs, as str(argparse.Namespace) and libpq DSNs print them
        ("Namespace(hf_token='hf_x y', lr=0.1)", "Namespace(hf_token='<redacted>', lr=0.1)"),
        ("host=db password='se cret' user=u", "host=db password='<redacted>' user=u"),
        ('--api_key="a b" --lr=1', '--api_key="<redacted>" --lr=1'),
        # JSON (or a dict's repr) inside a string
        ('{"api_key": "abc", "lr": "0.1"}', '{"api_key": "<redacted>", "lr": "0.1"}'),
        ("{'token': 'xyz', 'pad_token': '<pad>'}", "{'token': '<redacted>', 'pad_token': '<pad>'}"),
        ('{"password": "it\'s \\"q\\"", "n": 1}', '{"password": "<redacted>", "n": 1}'),
    ],
)
def test_credentials_in_values_are_cut_out(text: str, scrubbed: str) -> None:
    assert scrub_value(text) == scrubbed
    assert scrub_text(text) == scrubbed


@pytest.mark.parametrize(
    "text",
    ["Qwen/Qwen2.5-7B", "<|endoftext|>", "https://huggingface.co/Qwen/Qwen2.5-7B", "s3://bucket/key",
     "user@example.com", "lr=1e-6 beta=0.9", "x = 1", "task-sk-short", "hf_model_path", "/data/gsm8k/train.parquet", "http://proxy:8080"],
)  # fmt: skip
def test_ordinary_values_are_untouched(text: str) -> None:
    assert scrub_value(text) == text


# --- properties -------------------------------------------------------------------------------

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# Words no key rule looks at: ordinary keys are made of these.
_WORDS = st.sampled_from(
    ["lr", "batch", "size", "model", "path", "actor", "rollout", "critic", "max", "len", "per", "gpu", "n",
     "temperature", "tokens", "tokenizer", "name", "kl", "coef", "clip", "ratio", "data", "train", "files", "seed",
     "epochs", "use"]
)  # fmt: skip
_CREDENTIAL_WORDS = st.sampled_from(
    [["api", "key"], ["token"], ["hf", "token"], ["access", "token"], ["secret"], ["password"], ["passwd"],
     ["client", "secret"], ["access", "key", "id"], ["secret", "access", "key"], ["private", "key"], ["credentials"]]
)  # fmt: skip


def _spell(words: list[str], style: str) -> str:
    if style == "snake":
        return "_".join(words)
    if style == "upper":
        return "_".join(words).upper()
    if style == "dotted":
        return ".".join(words)
    if style == "kebab":
        return "-".join(words)
    return words[0] + "".join(w.capitalize() for w in words[1:])  # camel


_STYLES = st.sampled_from(["snake", "upper", "dotted", "kebab", "camel"])
ordinary_keys = st.one_of(
    st.builds(_spell, st.lists(_WORDS, min_size=1, max_size=4), _STYLES),
    st.builds(lambda key, style: _spell(key.split("_"), style), st.sampled_from(list(TOKENIZER)), _STYLES),
)
secret_keys = st.builds(
    lambda prefix, cred, style: _spell(prefix + cred, style), st.lists(_WORDS, max_size=2), _CREDENTIAL_WORDS, _STYLES
)
markers = st.text(_ALNUM, min_size=24, max_size=40).map(lambda s: "Zq" + s)  # "Zq": never a real word


def _jwt(marker: str) -> str:
    def part(data: dict[str, str]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    return f"{part({'alg': 'HS256'})}.{part({'sub': marker})}.{marker[:16]}"


# A credential, with the marker in it, in each format we recognise by value.
_FORMATS = [
    lambda m: f"http://user{m[:4]}:{m}@proxy.internal:8080",
    lambda m: f"postgresql://u:{m}@db.internal:5432/x",
    lambda m: f"https://{m}@github.com/org/repo.git",
    lambda m: f"sk-proj-{m}",
    lambda m: f"sk-ant-api03-{m}",
    lambda m: f"ghp_{(m * 2)[:36]}",
    lambda m: f"hf_{m.ljust(34, 'x')}",
    lambda m: f"xoxb-{m}",
    lambda m: "AKIA" + "".join(c for c in m.upper() if c.isalnum()).ljust(16, "Q")[:16],
    _jwt,
    lambda m: f"-----BEGIN PRIVATE KEY-----\n{m}\n-----END PRIVATE KEY-----",
    lambda m: f"https://tracker.example/api?api_key={m}&page=1",
    lambda m: f"Bearer {m}",
]
credentials = st.builds(lambda f, m: (f(m), m), st.sampled_from(_FORMATS), markers)
# Text around a credential in a note: words, then something that ends a word (a key glued to a
# word, "ask-proj-...", is another word: "mask-rcnn-resnet50-fpn-coco" must stay).
_BREAK = st.sampled_from([" ", "\n", ",", ";", ":", "(", ")", "[", "]", '"', "'", "="])
before_text = st.builds(lambda words, end: words + end if words else "", st.text(" abcxyz,;:", max_size=8), _BREAK)
after_text = st.builds(lambda start, words: start + words if words else "", _BREAK, st.text(" abcxyz,;:", max_size=8))

_NAME_WORDS = ["mask", "task", "risk", "rcnn", "resnet50", "fpn", "coco", "graph", "ppo", "grpo", "v2"]
ordinary_values = st.one_of(
    st.floats(allow_nan=False),
    st.integers(),
    st.booleans(),
    st.none(),
    st.text(_ALNUM + "_-./", max_size=30),
    st.sampled_from(list(TOKENIZER.values())),
    st.sampled_from(["Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B-Instruct", "deepseek-ai/DeepSeek-R1", "gpt2"]),
    # run and model names whose words end in a key prefix: "mask-rcnn-..." holds "sk-", "graph_..." "h_"
    st.builds("-".join, st.lists(st.sampled_from(_NAME_WORDS), min_size=2, max_size=6)),
    st.builds(
        lambda host, port, path: f"https://{host}:{port}/{path}",
        st.text("abcdefghij.", min_size=1, max_size=12).filter(lambda h: not h.startswith(".")),
        st.integers(1, 65535),
        st.text(_ALNUM + "/_-", max_size=20),
    ),
)


def configs(leaves: st.SearchStrategy[Any], keys: st.SearchStrategy[str] = ordinary_keys) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.dictionaries(keys, leaves, max_size=4),
        lambda inner: st.one_of(st.dictionaries(keys, inner, max_size=4), st.lists(inner, max_size=3)),
        max_leaves=20,
    )


def _plant(config: Any, path: list[int], key: str, value: Any) -> Any:
    """``config`` with ``{key: value}`` added in the dict ``path`` leads to (the top one if none)."""
    node = config
    for index in path:
        children = list(node.values()) if isinstance(node, dict) else node
        containers = [c for c in children if isinstance(c, (dict, list))]
        if not containers:
            break
        node = containers[index % len(containers)]
    if isinstance(node, list):
        node.append({key: value})
    else:
        node[key] = value
    return config


@settings(max_examples=300, deadline=None)
@given(configs(ordinary_values), st.lists(st.integers(0, 5), max_size=4), secret_keys, markers)
def test_a_value_under_a_secret_key_never_comes_out(config: Any, path: list[int], key: str, marker: str) -> None:
    planted = _plant({"root": config}, path, key, {"nested": marker} if len(marker) % 2 else marker)
    assert marker not in json.dumps(redact_config(planted))


@settings(max_examples=400, deadline=None)
@given(
    configs(ordinary_values),
    st.lists(st.integers(0, 5), max_size=4),
    ordinary_keys,
    credentials,
    before_text,
    after_text,
)
def test_a_credential_under_any_key_never_comes_out(
    config: Any, path: list[int], key: str, credential: tuple[str, str], before: str, after: str
) -> None:
    text, marker = credential
    planted = _plant({"root": config}, path, key, before + text + after)
    assert marker not in json.dumps(redact_config(planted))
    assert marker not in scrub_text(f"POST failed: {before}{text}{after}")


@settings(max_examples=300, deadline=None)
@given(configs(ordinary_values))
def test_ordinary_configs_come_out_untouched(config: Any) -> None:
    assert redact_config(config) == config


@settings(max_examples=200, deadline=None)
@given(ordinary_keys, ordinary_values)
def test_ordinary_labels_come_out_untouched(key: str, value: Any) -> None:
    from otel_tracking.api.spans import LABEL_PREFIX, state_attributes

    if value is None:
        return  # not an attribute value
    assert state_attributes(None, {key: value}) == {LABEL_PREFIX + key: value}


# --- real backends ----------------------------------------------------------------------------


def offline_env(monkeypatch: pytest.MonkeyPatch, root: Path, trackio_dir: Path, clearml_config: Path) -> None:
    for var, sub in (
        ("WANDB_DIR", "wandb"),
        ("WANDB_CACHE_DIR", "wandb/cache"),
        ("WANDB_DATA_DIR", "wandb/data"),
        ("WANDB_CONFIG_DIR", "wandb/config"),
        ("SWANLAB_LOG_DIR", "swanlog"),
        ("HOME", "home"),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(clearml_config))
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.setenv("TENSORBOARD_DIR", str(root / "tensorboard"))


def plant(backends: list[str]) -> tuple[dict[str, str], dict[str, Any], dict[str, str]]:
    """(a fresh marker per place a credential can hide, the plan secrets_training.py runs, the
    environment variables that carry some).  Every marker must appear in no output."""
    m = {
        name: "Zq" + random_secrets.token_hex(12)
        for name in (
            "wandb_api_key", "api_key", "hf_token", "camel_hf", "camel_wandb", "dotted", "nested_auth", "password",
            "secret", "access_key", "volc", "proxy", "db", "sk", "ghp", "label", "error", "generation", "header",
            "resource_key", "resource_url", "endpoint",
        )
    }  # fmt: skip
    config = {
        "trainer": {
            "wandb_api_key": m["wandb_api_key"],
            "logger": backends,
            "project_name": "secrets",
            "wandb_proxy": f"http://proxyuser:{m['proxy']}@127.0.0.1:9",  # wandb must still use it
        },
        "api_key": m["api_key"],
        "hfToken": m["camel_hf"],
        "wandbApiKey": m["camel_wandb"],
        "auth.token": m["dotted"],
        "auth": {"token": m["nested_auth"]},
        "data": {"hf_token": m["hf_token"], "tokenizer": "Qwen/Qwen2.5-7B", "max_prompt_tokens": 512},
        "actor_rollout_ref": {"model": {"path": "Qwen/Qwen2.5-7B", **TOKENIZER}},
        "db": {"password": m["password"], "host": "localhost", "url": f"postgresql://u:{m['db']}@db.internal/x"},
        "notes": f"sk-proj-{m['sk']}",
        "cloud": [{"secret": m["secret"]}, {"access_key": m["access_key"]}],
        "VOLC_SECRET_ACCESS_KEY": m["volc"],
    }
    plan = {
        "backends": backends,
        "config": config,
        "logged": f"pushed with ghp_{m['ghp']}0000000000",
        "label": f"http://labeluser:{m['label']}@rollout.internal:8000/v1",
        "error": f"POST https://alice:{m['error']}@tracker.example/api refused",
        "generation": f"call the search tool with key hf_{m['generation']}abcdefgh",
    }
    env = {
        "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={m['header']}",
        "OTEL_RESOURCE_ATTRIBUTES": f"api_key={m['resource_key']},proxy=http://u:{m['resource_url']}@h:1,team=rl",
    }
    return m, plan, env


def leaks(markers: dict[str, str], where: str, text: str) -> list[str]:
    return [f"{name} in {where}" for name, marker in markers.items() if marker in text]


def received_leaks(markers: dict[str, str], receiver: HttpReceiver) -> list[str]:
    """Everything the OTLP endpoint received, as protobuf text (span events and status messages
    included), but the request headers."""
    received = receiver.received
    with received.lock:
        text = "\n".join(str(request) for request in (*received.metrics, *received.traces, *received.logs))
    return leaks(markers, "OTLP", text)


def written_leaks(markers: dict[str, str], *roots: Path) -> list[str]:
    found = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                found += [
                    f"{name} in {path}"
                    for name, marker in markers.items()
                    if marker.encode() in data or marker.encode().hex().encode() in data
                ]
    return found


def mlflow_params(tracking_uri: str, experiment: str) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return dict(run.data.params)


def assert_kept(params: dict[str, str]) -> None:
    """What is not secret reached the backend as it was; what is, redacted but recognisable."""
    assert params["data/tokenizer"] == "Qwen/Qwen2.5-7B"
    assert params["data/max_prompt_tokens"] == "512"
    for key, value in TOKENIZER.items():
        assert params[f"actor_rollout_ref/model/{key}"] == str(value), key
    assert params["api_key"] == params["hfToken"] == params["auth.token"] == REDACTED
    assert params["trainer/wandb_proxy"] == "http://<redacted>@127.0.0.1:9"
    assert params["db/url"] == "postgresql://<redacted>@db.internal/x"
    assert params["notes"] == REDACTED


def test_what_code_sets_on_a_span_itself_is_scrubbed_on_the_way_out(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trace_state`` yields its span: attributes, events, an exception and a status that code
    sets on it are scrubbed as labels are, before any sink sees them (the file sink's events
    file, OTLP), and what is not secret around them is kept."""
    from opentelemetry.trace import Status, StatusCode

    m = {name: "Zq" + random_secrets.token_hex(12) for name in ("url", "key", "event", "exception", "status")}
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("scrub", "spans", default_backend=["file"])
        with trace_state("upload", step=1) as span:
            span.set_attribute("db.url", f"postgresql://u:{m['url']}@db/x")
            span.set_attribute("hfToken", m["key"])
            span.add_event("retry", {"request": f"https://h/api?access_token={m['event']}&page=2"})
            span.record_exception(ValueError(f"cannot reach https://u:{m['exception']}@tracker.example"))
            span.set_status(Status(StatusCode.ERROR, f"Authorization: Bearer {m['status']}abcdefgh"))
        tracking.log({"loss": 1.0}, step=1)
        tracking.finish()
        found = received_leaks(m, receiver)
        sent = next(s for s in receiver.received.spans() if s["name"] == "upload")
    events_file = isolated / "scrub" / "spans.events.jsonl"
    found += written_leaks(m, isolated)
    assert found == [], found
    assert sent["attributes"]["db.url"] == "postgresql://<redacted>@db/x"
    assert sent["attributes"]["hfToken"] == REDACTED
    written = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert any("https://h/api?access_token=<redacted>&page=2" in json.dumps(line) for line in written)
    assert any("https://<redacted>@tracker.example" in json.dumps(line) for line in written)


@pytest.mark.backend
def test_span_and_event_names_are_scrubbed_and_so_are_the_tracker_keys_made_of_them(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trace_state(f"download https://user:{pw}@host/...")``: the span's name, an event's name and
    the ``timing_s/<name>`` key made of the name carry no credential, in OTLP or the file sink."""
    m = {name: "Zq" + random_secrets.token_hex(12) for name in ("span", "event", "quoted")}
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        tracking = Tracking("scrub", "names", default_backend=["file", "tensorboard"])
        with trace_state(f"download https://user:{m['span']}@host/ckpt", step=1) as span:
            span.add_event(f"retry password={m['event']}")
            span.record_exception(ValueError(f"connection failed: Namespace(password='{m['quoted']}')"))
        tracking.log({"loss": 1.0}, step=1)
        tracking.finish()
        found = received_leaks(m, receiver)
        names = [s["name"] for s in receiver.received.spans()]
    found += written_leaks(m, isolated)
    assert found == [], found
    assert "download https://<redacted>@host/ckpt" in names
    from tests.test_backend_tensorboard import read_events

    scalars, _, _ = read_events(isolated / "tensorboard_log" / "scrub" / "names")
    keys = [key for key in scalars if key.startswith("timing_s/")]  # the timing key, made of the scrubbed name
    assert keys and all("https://<redacted>@host/ckpt" in key for key in keys), sorted(scalars)
    assert not [key for key in scalars if any(marker in key for marker in m.values())]


@pytest.mark.backend
@pytest.mark.parametrize("shape", ["namespace", "object", "pydantic"])
def test_every_config_shape_a_tracker_accepts_is_redacted(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """``config=argparse.Namespace(...)`` (the common non-Hydra config; wandb accepts it), an
    object with attributes, a pydantic model: their credentials never reach the offline run files
    that ``wandb sync`` uploads, and the rest of the config does, as wandb shows it."""
    import argparse

    import pydantic
    import wandb

    from tests import readers_wandb

    wandb.teardown()
    for var, sub in (("WANDB_DIR", "wandb"), ("WANDB_CACHE_DIR", "wandb/cache"), ("WANDB_CONFIG_DIR", "wandb/config")):
        (isolated / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(isolated / sub))
    m = {name: "Zq" + random_secrets.token_hex(12) for name in ("wandb_api_key", "hf_token", "nested")}

    class Plain:
        def __init__(self, **values: Any) -> None:
            self.__dict__.update(values)

    class Model(pydantic.BaseModel):
        wandb_api_key: str
        hf_token: str
        lr: float
        data: dict[str, Any]

    values = {"wandb_api_key": m["wandb_api_key"], "hf_token": m["hf_token"], "lr": 1e-6}
    nested = {"path": "/data/gsm8k", "password": m["nested"]}
    config = {
        "namespace": lambda: argparse.Namespace(**values, data=argparse.Namespace(**nested)),
        "object": lambda: Plain(**values, data=Plain(**nested)),
        "pydantic": lambda: Model(**values, data=nested),
    }[shape]()
    tracking = Tracking("scrub", f"config-{shape}", default_backend=["wandb"], config=config)
    tracking.log({"loss": 1.0}, step=1)
    tracking.finish()
    assert written_leaks(m, isolated) == []
    stored = readers_wandb.only_run(isolated / "wandb").config()
    assert stored["lr"] == 1e-6 and stored["wandb_api_key"] == REDACTED and stored["hf_token"] == REDACTED
    assert stored["data"] == {"path": "/data/gsm8k", "password": REDACTED}


@pytest.mark.backend
def test_a_planted_secret_appears_nowhere(
    isolated: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    trackio_dir: Path,
    clearml_config_file: Path,
) -> None:
    """In this process (its bridge process's output is seen by the next test)."""
    import wandb

    wandb.teardown()
    offline_env(monkeypatch, isolated, trackio_dir, clearml_config_file)
    markers, plan, env = plant(BACKENDS)
    caplog.set_level(logging.DEBUG)
    with HttpReceiver() as receiver:
        # Credentials in the endpoint: sent (as basic auth), never shown.
        endpoint = receiver.endpoint.replace("://", f"://otlpuser:{markers['endpoint']}@")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        tracking = Tracking(f"secrets-{isolated.name}", "run", default_backend=BACKENDS, config=plan["config"])
        for step in range(1, 4):
            with trace_state("rollout", state_lane_id=0, endpoint=plan["label"], token=markers["secret"], step=step):
                tracking.log({"train/loss": 1.0 / step, "notes/text": plan["logged"]}, step)
        with pytest.raises(ConnectionError), trace_state("upload", step=3):
            raise ConnectionError(plan["error"])
        ValidationGenerationsLogger().log(BACKENDS, [(plan["generation"], "a", 1.0)], 3)
        found = leaks(markers, "where", json.dumps(tracking.where()))
        stats = tracking.finish()
        assert all(counts["dropped"] == 0 for counts in stats.values()), stats
        # The header and the endpoint's credentials were sent where they belong...
        assert any(h.get("x-api-key") == markers["header"] for h in receiver.received.headers)
        basic = base64.b64encode(f"otlpuser:{markers['endpoint']}".encode()).decode()
        assert any(h.get("authorization") == f"Basic {basic}" for h in receiver.received.headers)
        # ...and is in nothing that was recorded.
        assert receiver.received.spans() and list(receiver.received.gauge_points()) and receiver.received.logs
        found += received_leaks(markers, receiver)
    found += written_leaks(markers, isolated, trackio_dir)
    out, err = capsys.readouterr()
    found += leaks(markers, "stdout", out) + leaks(markers, "stderr", err)
    found += leaks(markers, "log records", caplog.text)
    assert found == [], found
    assert_kept(mlflow_params(f"sqlite:///{isolated / 'mlflow.db'}", f"secrets-{isolated.name}"))


@pytest.mark.backend
def test_a_planted_secret_appears_nowhere_in_a_training_process_of_its_own(tmp_path: Path) -> None:
    """The training script in a process of its own, with its bridge process: everything either
    prints (the child inherits the script's stdout and stderr), every log record of either at
    DEBUG, every file and everything OTLP received is grepped.  The local backends of the issue:
    file, console, TensorBoard, MLflow (local sqlite store), wandb (offline), Trackio."""
    backends = ["file", "console", "tensorboard", "mlflow", "wandb", "trackio"]
    markers, plan, env = plant(backends)
    markers["argv"] = "Zq" + random_secrets.token_hex(12)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    # Both processes log at DEBUG: Python imports sitecustomize from PYTHONPATH at start-up, and
    # the bridge process's PYTHONPATH is the script's sys.path.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import logging\nlogging.basicConfig(level=logging.DEBUG, format='[pid %(process)d] %(name)s: %(message)s')\n"
    )
    data = tmp_path / "data"
    data.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if k.startswith(("PATH", "LANG", "LC_", "TMPDIR"))},
        **env,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
        "HOME": str(data / "home"),
        "OTEL_TRACKING_SPOOL_DIR": str(data / "spool"),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(data / "wandb"),
        "WANDB_CACHE_DIR": str(data / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(data / "wandb-config"),
        "WANDB_DATA_DIR": str(data / "wandb-data"),
        "TRACKIO_DIR": str(data / "trackio"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{data / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "TENSORBOARD_DIR": str(data / "tensorboard"),
    }
    for sub in ("home", "wandb", "wandb-cache", "wandb-config", "wandb-data"):
        (data / sub).mkdir()
    with HttpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        done = subprocess.run(
            [sys.executable, "-m", "tests.secrets_training", str(plan_path), f"data.hf_token={markers['argv']}"],
            cwd=data,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        # finish() returned: everything was exported (the script printed the stats last).
        stats = json.loads(done.stdout.strip().splitlines()[-1])
        assert set(stats) >= set(backends), stats
        assert all(c["dropped"] == c["spooled"] == c["failed"] == 0 for c in stats.values()), stats
        assert any(h.get("x-api-key") == markers["header"] for h in receiver.received.headers)
        spans = receiver.received.spans()
        found = received_leaks(markers, receiver)
    # What was captured holds the bridge process's log records too (two pids), and its wandb's.
    pids = set(re.findall(r"^\[pid (\d+)\]", done.stderr, re.MULTILINE))
    assert len(pids) == 2, done.stderr[-3000:]
    assert "wandb: Find logs at" in done.stdout + done.stderr
    found += leaks(markers, "stdout", done.stdout) + leaks(markers, "stderr", done.stderr)
    found += written_leaks(markers, data)
    assert found == [], found
    assert_kept(mlflow_params(f"sqlite:///{data / 'mlflow.db'}", "secrets"))
    # A label keeps its host; a failed phase says why, without the password.
    labels = {span["attributes"].get("ml.label.endpoint") for span in spans if span["name"] == "rollout"}
    assert labels == {"http://<redacted>@rollout.internal:8000/v1"}


@pytest.mark.backend
def test_the_first_export_failure_says_why_once_without_credentials(caplog: pytest.LogCaptureFixture) -> None:
    """A tracker's export that raises: the first failure's reason is a warning (in the bridge
    process too, whose stderr is the training process's), with credentials in URLs scrubbed."""
    import logging

    from otel_tracking.exporters._base import StepRecord, TrackerMetricExporter, TrackerSession

    class Refusing(TrackerSession):
        @classmethod
        def open(cls, context: object) -> TrackerSession:
            return cls()

        def write_step(self, record: StepRecord) -> bool:
            raise ConnectionError("POST https://alice:s3cret-pw@tracker.example/api refused")

        def write_timing(self, step: int, key: str, seconds: float) -> bool:
            return True

        def finish(self, exit_code: int = 0) -> None:
            return None

    exporter = TrackerMetricExporter(Refusing())
    record = StepRecord(step=1, scalars={"loss": 1.0})
    with caplog.at_level(logging.DEBUG, logger="otel_tracking"):
        for _ in range(3):
            assert exporter.export_records([record]).name == "FAILURE"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "ConnectionError: POST https://<redacted>@tracker.example/api refused" in warnings[0]
    # The DEBUG records' tracebacks quote the message too: scrubbed as well.
    assert any(r.exc_info for r in caplog.records) and "Traceback" in caplog.text
    assert "s3cret" not in caplog.text and "alice" not in caplog.text


@pytest.mark.backend
def test_a_trackers_own_error_quoting_its_credentials_is_scrubbed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's error names the URL it failed on, password and all; the bridge's logger (a child
    of ``otel_tracking``, so it needs a filter of its own) prints it scrubbed."""
    from otel_tracking.exporters import mlflow as bridge
    from otel_tracking.exporters._base import TrackerContext

    marker = "Zq" + random_secrets.token_hex(12)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    env = {"MLFLOW_TRACKING_URI": f"http://mluser:{marker}@127.0.0.1:1"}  # nothing listens on port 1
    with caplog.at_level(logging.DEBUG):
        assert bridge.MlflowSession.open(TrackerContext("p", "e", env=env), attempts=1, retry_sleep_s=0) is None
    assert "attempt 1/1 failed: API request to http://<redacted>@127.0.0.1:1/" in caplog.text
    assert marker not in caplog.text and "mluser" not in caplog.text


# Adversarial text for the scanners: runs of the characters the patterns look for, as a collapsed
# generation ("The answer is ====...") has them.
ADVERSARIAL = [
    "=",
    "a=",
    "password=",
    "eyJ",
    "://",
    "@",
    "Bearer ",
    "sk-",
    "-----BEGIN RSA PRIVATE KEY-----",
    "hf_",
    '"a": "',
    '"token": ',
    "'",
    ":",
]


@pytest.mark.parametrize("unit", ADVERSARIAL)
def test_scrubbing_is_linear_in_the_length_of_the_text(unit: str) -> None:
    """Four times the text costs about four times as much, not sixteen (the walk of ``=`` signs
    and the JWT pattern were quadratic: 60 kB of ``=`` blocked ``log()`` for 19 s).  The best of
    five runs each, as a ratio, so a loaded machine does not decide."""
    import time

    from otel_tracking.signals.redact import scrub_value

    def cost(repeats: int) -> float:
        text = "The answer is " + unit * repeats
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            scrub_value(text)
            best = min(best, time.perf_counter() - started)
        return best

    n = 20_000 // len(unit) + 1
    small, large = cost(n), cost(4 * n)
    assert large / max(small, 1e-6) < 9, (unit, small, large)


def test_a_span_like_one_found_clean_is_still_scrubbed_when_anything_differs() -> None:
    """A worker's spans repeat (phase, lane, step): ``scrubbed_span`` scrubs each such set once and
    lets the next ones through as they are.  A span that differs in any way from one found clean (a
    label, a value, its name, an event, a status, an attribute code set on it) is scrubbed again,
    and a secret in it never passes, however many clean ones came before."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, SpanContext, Status, StatusCode

    from otel_tracking.delivery.scrubbing import scrubbed_span

    secret = "Zq" + random_secrets.token_hex(12)
    tracer = TracerProvider().get_tracer("test")
    linked = SpanContext(trace_id=7, span_id=9, is_remote=True)

    def ended(name: str, attributes: dict[str, Any], then: Any = None, links: Any = ()) -> Any:
        span = tracer.start_span(name, attributes=attributes, links=links)
        if then is not None:
            then(span)
        span.end()
        return span

    clean = {"ml.lane": "rank_0", "ml.step": 1}
    for _ in range(3):  # found clean once, then let through untouched
        span = ended("update_actor", clean)
        assert scrubbed_span(span) is span
    differing = [
        ended("update_actor", {**clean, "ml.label.url": f"https://u:{secret}@host/x"}),
        ended("update_actor", {"ml.lane": f"rank_0 password={secret}", "ml.step": 1}),
        ended("update_actor", {**clean, "hfToken": secret}),
        ended("update_actor", {**clean, "hfToken": 1}),  # a secret key's number
        ended(f"update_actor https://u:{secret}@host/x", clean),
        ended("update_actor", clean, lambda s: s.set_attribute("db.url", f"postgresql://u:{secret}@db/x")),
        ended("update_actor", clean, lambda s: s.add_event("retry", {"request": f"https://h/?access_token={secret}"})),
        ended("update_actor", clean, lambda s: s.set_status(Status(StatusCode.ERROR, f"Bearer {secret}abcdefgh"))),
        ended("update_actor", clean, links=[Link(linked, {"from": f"https://u:{secret}@host/x"})]),
    ]
    for _ in range(2):  # the first time, and again once each was seen
        for span in differing:
            out = scrubbed_span(span)
            assert out is not span
            shown = [dict(out.attributes or {}), [dict(e.attributes or {}) for e in out.events],
                     [dict(link.attributes or {}) for link in out.links]]  # fmt: skip
            text = json.dumps([out.name, *shown, out.status.description])
            assert secret not in text and '"hfToken": 1' not in text, text
    for _ in range(2):
        span = ended("update_actor", clean)
        assert scrubbed_span(span) is span

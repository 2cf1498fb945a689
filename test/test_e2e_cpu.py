"""End to end on CPU: the installed fork serves a tiny Llama through the real ``launch_server``.

One server answers ``/generate`` (greedy twice: same tokens), ``/v1/completions`` and a
streamed completion over HTTP on 127.0.0.1, logs the fork-flags line and stops with no error
in its log. Startup refusals that need no GPU are real server starts that exit non-zero
with the message. The GPU matrix (``tools/e2e/matrix.py``) serves DeepSeek-V4 + DSpark.
"""

from __future__ import annotations

import os

import pytest
from conftest import REPO, UPSTREAM
from e2e.checkpoints import write_tiny_llama
from e2e.server import Server, refusal

import sglang.fork as fork

pytestmark = pytest.mark.e2e

CPU_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--load-format",
    "dummy",
    "--mem-fraction-static",
    "0.05",
    "--max-total-tokens",
    "4096",
]
# The import-only stand-ins (sgl_kernel, torchvision, ...) come first, as in the tests.
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tools" / "standins"), os.environ.get("PYTHONPATH", "")]
    ),
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with Server(
        tiny_llama, CPU_ARGS, env=CPU_ENV, log_path=log, start_timeout=240
    ) as s:
        yield s
    assert s.proc.returncode is not None
    errors = s.errors()
    assert not errors, f"errors in the server log {log}:\n" + "\n".join(errors)


def test_startup_line_lists_the_fork_flags(server):
    line = next(l for l in server.log().splitlines() if "fork flags:" in l)
    assert f"sglang {fork.fork_version()} fork flags:" in line
    for flag in fork.fork_flags():
        assert f"{flag}=" in line


def test_generate_greedy_is_repeatable(server):
    body = {
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }
    first, second = server.post("/generate", body), server.post("/generate", body)
    assert first["meta_info"]["completion_tokens"] == 16
    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_completions(server):
    out = server.post(
        "/v1/completions",
        {"model": "default", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
    )
    assert out["object"] == "text_completion"
    assert out["usage"]["completion_tokens"] == 8
    chunks = list(
        server.stream(
            "/v1/completions",
            {"model": "default", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
        )
    )
    assert (
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        == out["choices"][0]["text"]
    )


def test_openai_chat(server):
    out = server.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 8


def _refused(tiny_llama, args):
    r = refusal(tiny_llama, CPU_ARGS + args, env=CPU_ENV, timeout=240)
    assert r.returncode != 0, r.stdout[-3000:]
    return r.stdout


def test_wrong_fork_build_is_refused_at_startup(tiny_llama):
    out = _refused(tiny_llama, ["--fork-expect-version", f"{UPSTREAM}+fork.1.0000000"])
    assert "refusing to start another patch series" in out


def test_dspark_only_flag_without_dspark_is_refused_at_startup(tiny_llama):
    out = _refused(tiny_llama, ["--speculative-dspark-verify-cap", "3"])
    assert "--speculative-dspark-verify-cap" in out and "DSPARK" in out

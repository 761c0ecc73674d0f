"""LiteLLM's proxy, offline, as a real model server nobody here wrote.

``running_proxy`` starts ``litellm --config <home>/config.yaml`` on a free 127.0.0.1
port with models whose ``mock_response`` answers without any vendor (``MODELS``): the
Anthropic Messages API, the OpenAI Responses API and Chat Completions, and the error
shapes its mocks produce. Its cost map is the local copy and its telemetry is off, so
nothing leaves the machine. ``KEY`` is its master key, the provider key of the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from support.fleet import free_port, http_answers, terminate, wait_for

KEY = "sk-litellm-test-0123456789abcdef-SECRET"
START_SECONDS = 180


def mock(name: str, vendor: str, response: object) -> dict[str, object]:
    return {
        "model_name": name,
        "litellm_params": {
            "model": f"{vendor}/{name}",
            "api_key": "unused",
            "mock_response": response,
        },
    }


def cut_reply(finish_reason: str, content: str) -> dict[str, object]:
    """A Chat Completions mock without usage, which the API allows."""
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "message": {"role": "assistant", "content": content},
            }
        ]
    }


# Only Chat Completions takes a whole reply as its mock; the other two protocols answer
# with text, or fail as the named LiteLLM exception says.
MODELS = [
    mock("claude-mock", "anthropic", "(anthropic answer)"),
    mock("claude-rate-limited", "anthropic", "litellm.RateLimitError"),
    mock("gpt-mock", "openai", "(responses answer)"),
    mock("chat-mock", "openai", "(chat answer)"),
    mock("chat-cut", "openai", cut_reply("length", "(defun cut")),
    mock("chat-filtered", "openai", cut_reply("content_filter", "")),
    mock("chat-rate-limited", "openai", "litellm.RateLimitError"),
    mock("chat-broken", "openai", "litellm.InternalServerError"),
]


@contextmanager
def running_proxy(home: Path) -> Iterator[str]:
    """The base URL of a LiteLLM proxy answering from ``MODELS``, until the block ends."""
    config = home / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_list": MODELS,
                "litellm_settings": {"telemetry": False, "num_retries": 0},
                "router_settings": {"num_retries": 0},
            }
        )
    )
    port = free_port()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "LITELLM_MASTER_KEY": KEY,
        # The cost map shipped in the package, not one fetched from the network.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "NO_PROXY": "*",
    }
    log_path = home / "litellm.log"
    command = [str(Path(sys.executable).with_name("litellm")), "--config", str(config)]
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=home,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: http_answers(f"{url}/health/liveliness", server, log_path, "litellm"),
            START_SECONDS,
            f"litellm on {url}",
            0.5,
        )
        yield url
    finally:
        terminate(server, 20)
